"""What the benchmark measures and the targets it is held to."""
SAVE_VARIANTS = ("raw_write", "torch_save", "atomic_save", "sharded_save")
READ_VARIANTS = ("raw_read", "verified_load", "raw_scan")
VARIANTS = SAVE_VARIANTS + READ_VARIANTS
MEMORY_VARIANTS = ("torch_save", "atomic_save", "sharded_save")
TARGETS = {"sharded_save_vs_raw": (">=", 0.9), "atomic_save_vs_torch_save": (">=", 1.0),
           "verified_load_vs_raw_read": (">=", 0.8), "peak_extra_mem_frac": ("<=", 0.10),
           # chained checkpoints (chains.py)
           "incremental_bytes_frac_frozen": ("<=", 0.15), "incremental_bytes_frac_sparse": ("<=", 0.05),
           "chain_restore_vs_full": ("<=", 1.5), "compress_ratio_bf16": (">=", 1.40),
           "compress_ratio_fp32": (">=", 1.15), "shuffle_gain": (">=", 1.08),
           "compressed_save_vs_plain": ("<=", 1.5), "async_stall_vs_copy": ("<=", 1.5),
           # the cold tier (tiers.py)
           "demotion_stall_vs_copy": ("<=", 0.1)}
# What a ratio needs before it can be called met or missed: this many rounds, and variants whose
# median sample takes this long (shorter samples are mostly noise on a shared machine).
MIN_ROUNDS = 7
MIN_SAMPLE_S = 0.5
MAX_INNER_CALLS = 64   # timed calls summed into one sample, at most (see chains.async_stall)
# Ratio -> (numerator variant, denominator variant): the per-round ratio of two timed variants.
TIMED_RATIOS = {"sharded_save_vs_raw": ("raw_write", "sharded_save"),
                "atomic_save_vs_torch_save": ("torch_save", "atomic_save"),
                "verified_load_vs_raw_read": ("raw_read", "verified_load")}
_READ_CHUNK = 8 << 20
_SAMPLE_S = 0.005
_MARKER = "<!-- reference-bench -->"
