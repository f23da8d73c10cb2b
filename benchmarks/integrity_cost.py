"""What the integrity checks cost on one built-in model (CPU): the zoo's checks and the fingerprint.

    python benchmarks/integrity_cost.py [--model smollm2-135m]

Prints, for the model's converted folder: the cheap check on every load (`is_current`: stat
calls against the stamp), the full check run after a file changed (`verify_folder`: sha256 of
every file), and the weight fingerprint a bridge compares in `check` (first call, then
remembered). Fetches and converts the model first if it is not cached.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import torch

from bridgecache.models import zoo
from bridgecache.models.fingerprint import weight_fingerprint
from bridgecache.models.manifest import is_current, verify_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=list(zoo.BUILTIN_MODELS))
    args = parser.parse_args()
    folder = zoo.model_dir(args.model)
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())

    start = time.perf_counter()
    assert is_current(folder)
    cheap = time.perf_counter() - start
    start = time.perf_counter()
    problem = verify_folder(folder)
    full = time.perf_counter() - start
    assert problem is None, problem

    model, _ = zoo.load_model(args.model)
    start = time.perf_counter()
    weight_fingerprint(model)
    first = time.perf_counter() - start
    start = time.perf_counter()
    weight_fingerprint(model)
    again = time.perf_counter() - start

    print(f"{args.model}: {size:,} bytes in {folder}")
    machine = platform.processor() or platform.machine()
    print(f"{machine}, torch threads {torch.get_num_threads()}, {datetime.date.today()}")
    print("| check | seconds |\n|---|---|")
    print(f"| cheap check on each load (is_current) | {cheap:.5f} |")
    print(f"| full check after a change (verify_folder, sha256 of {size / 1e6:.0f} MB) | {full:.2f} |")
    params = sum(1 for _ in model.parameters())
    print(f"| weight fingerprint, first call ({params} parameters) | {first:.3f} |")
    print(f"| weight fingerprint, remembered | {again:.5f} |")


if __name__ == "__main__":
    main()
