"""Bytes in and out, below `data`, `run` and `checkpoints`: reads over a network with retries and a read
timeout (`remote`), atomic writes (`atomic`), the lock that keeps a second job out (`lock`) and the
output directories every command writes through (`outdir`)."""
