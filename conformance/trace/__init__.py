"""What a traced run did: strace's output parsed (`strace`), syscalls turned into filesystem operations
(`operations`), the recorded run (`recording`), which save each operation belongs to (`saves`), and what varies
between two runs of one trainer (`alignment`)."""
