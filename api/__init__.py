"""HTTP API and the `longctx` command line.

OpenMP threads sleep while they wait (`OMP_WAIT_POLICY=PASSIVE`, set here, before anything of
ours imports torch, unless the environment says otherwise): a server's engine thread shares the
cores with its event loop, tokenizer and Redis threads, and torch's spinning workers then starved
them. Measured on 2 busy cores (load average 6-8), demo model, bf16, 2 threads: 1,157 ms per
streamed token with spinning workers, 61 ms with sleeping ones (37 ms with `--threads 1`).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
