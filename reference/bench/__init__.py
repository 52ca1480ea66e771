"""`python -m resume_conformance.reference.bench`: how much the library's guarantees cost, measured in one run.

Six variants (and one for reference) run on the same fp32, model-like state (a few large tensors, many small ones), the
variants alternating round by round so that background noise hits all of them alike. A ratio is
judged on its per-round values (its two variants ran side by side in each round): its median, its
spread (25th..75th percentile) and its range are reported, and it is "met" only if the whole
spread meets the target, "missed" if the whole spread misses it, and otherwise "inconclusive"
(also with fewer than 7 rounds, or when a sample takes under 0.5 s: use a larger --size-mb).

    raw_write      the tensors' bytes written with os.write to one file, then fsync
    torch_save     torch.save(payload, path), then fsync of the file
    atomic_save    reference.save_file(payload, path): tree digest, temp + hash-while-writing +
                   fsync + rename + directory fsync
    sharded_save   reference.save_sharded(payload, dir): default settings, every file hashed,
                   index.json committed last
    raw_read       read the raw file back into freshly allocated tensors, sha256 over its bytes
                   (the least a verified load must do: get the bytes into tensors, hash them)
    verified_load  reference.load_sharded(dir, verify=True): sizes and hashes checked before
                   anything is deserialized, weights_only=True
    raw_scan       (for reference, in no ratio) sha256 of the raw file through one reused 8 MiB
                   buffer: no tensors are built, so no fresh memory is faulted in

`payload` is reference.capture(state, global_step=1), the same object for every save variant.
Each round first deletes the previous round's files; before every timed step dirty data is
flushed (sync) and the disk is let go idle (no request in flight, so background discards of freed
blocks do not land in a timed step). Before every read the files to be read are
evicted from the page cache (posix_fadvise DONTNEED on each file, checked with mincore), so
reads are cold without dropping every other process's cache; if eviction cannot be confirmed,
/proc/sys/vm/drop_caches is tried, and failing that every read variant runs warm (files
pre-read) and the output says so.

Peak extra memory of a save is measured in a fresh child process per variant: the child builds
the state, records its resident set size (RSS), runs the save while a thread samples
/proc/self/statm every 5 ms, and reports max(sampled peak, ru_maxrss if the save raised it)
minus the baseline, as a fraction of the state's bytes.

Modules: `cli` (options, priority, the work directory), `run` (the alternating loop), `workload` (the
state and the raw baselines), `disk` (flushed, idle disks and checked cold reads), `judge` (a ratio
against its target), `constants` (what is measured and the targets), `memory` (peak extra memory, one
child per variant), `chains` (chained checkpoints), `tiers` (a demotion beside training), `output`
(the tables).
"""
