"""How fast the suite is, measured side by side in one run: `python -m conformance.bench` (`measure`), and the warm
trial of this checkout against an older one (`ab`), and what the state digests cost (`digests`)."""
