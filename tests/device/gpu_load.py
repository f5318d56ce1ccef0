"""Keep GPU 0 busy for card_check.sh's "load" captures: bf16 matrix products on a few GiB, until killed.

    python3 gpu_load.py READY_FILE [SECONDS]

Touches READY_FILE once the first products have run (the card is at load clocks and lists this process).
Plain allocations only (no managed memory). CARD_LOAD_DRY=1 only touches READY_FILE and sleeps: the dry run
against the simulator, whose scenario lists the processes itself.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main(argv: list) -> int:
    ready, seconds = Path(argv[0]), float(argv[1]) if len(argv) > 1 else 120.0
    end = time.monotonic() + seconds
    if os.environ.get("CARD_LOAD_DRY") == "1":
        ready.touch()
        time.sleep(seconds)
        return 0
    # The device image's python3 has torch; imported here so the dry run needs none.
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        print("gpu_load: torch sees no GPU", file=sys.stderr)
        return 3
    # 4 GiB held, so the process shows a clear used_memory in nvidia-smi and NVML.
    hold = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    started, products = time.monotonic(), 0
    while time.monotonic() < end:
        for _repeat in range(20):
            a @ b
        torch.cuda.synchronize()
        products += 20
        if not ready.exists():
            print(f"gpu_load: pid {os.getpid()} running, {hold.numel() >> 30} GiB held", flush=True)
            ready.touch()
    rate = products * 2 * 8192**3 / (time.monotonic() - started) / 1e12
    print(f"gpu_load: {products} products, {rate:.0f} TFLOP/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
