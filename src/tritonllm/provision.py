"""`tritonllm-models`: prepare the models once (bundled SmolLM2 as safetensors, tiny test model)."""

from __future__ import annotations

import argparse
import time

from tritonllm import model_files as models


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritonllm-models", description=__doc__)
    parser.add_argument("action", choices=["prepare", "bundled", "tiny", "where"])
    parser.add_argument("--force", action="store_true", help="convert again even if cached")
    args = parser.parse_args(argv)
    if args.action == "where":
        print(f"bundled: {models.bundled_dir()}\ntiny:    {models.tiny_dir()}")
        return 0
    if args.action in ("prepare", "bundled"):
        start = time.perf_counter()
        fresh = args.force or not (models.bundled_dir() / "config.json").exists()
        path = models.prepare_bundled(force=args.force)
        print(f"bundled model: {path}" + (f" (converted in {time.perf_counter() - start:.1f} s)" if fresh else ""))
    if args.action in ("prepare", "tiny"):
        print(f"tiny model:    {models.prepare_tiny(force=args.force)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
