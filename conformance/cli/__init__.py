"""Commands beside the pytest plugin: `python -m conformance init` (`init`) and `python -m conformance soak`
(`soak`), and the CPU load a soak runs under: its burner processes and the load average it prints (`load`)."""
