"""Load time: a Llama-3-8B-shape checkpoint (16 GB of bf16 safetensors) straight onto the GPU,
dyngen's `Model.load` against transformers' `from_pretrained(device_map=...)`.

The checkpoint is written first (random weights drawn on the GPU, 4 shards plus an index, as
Hugging Face ships them); each engine then loads it in a fresh subprocess, so the figures include
reading the files (from the OS page cache: the files were just written) and report the
subprocess's peak host memory (max RSS): dyngen copies one tensor at a time, so its peak stays
near the size of the largest tensor rather than the model.

    python benchmarks/load_time.py [--dir /tmp/dyngen-load] [--layers 32] [--small]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import add_common_args, bench_config, device_name, random_model, report

from dyngen_core.model.loader import checkpoint_layout

SHARDS = 4


def write_checkpoint(folder: Path, config: dict[str, Any], device: torch.device) -> int:
    """Random weights in Hugging Face's tensor names, sharded; returns the bytes written."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    model = random_model(config, device)
    params = dict(model.named_parameters(remove_duplicate=False))
    layout = checkpoint_layout(model.config)
    names = list(layout)
    per_shard = -(-len(names) // SHARDS)
    weight_map: dict[str, str] = {}
    total = 0
    for shard in range(SHARDS):
        file = f"model-{shard + 1:05d}-of-{SHARDS:05d}.safetensors"
        tensors = {}
        for name in names[shard * per_shard:(shard + 1) * per_shard]:
            slot = layout[name]
            band = params[slot.param][slot.row_start:slot.row_start + slot.shape[0]]
            tensors[name] = band.reshape(slot.shape).contiguous().cpu()
            weight_map[name] = file
            total += tensors[name].numel() * tensors[name].element_size()
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    del model, params
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return total


def load_once(engine: str, folder: Path, device: str) -> dict[str, float]:
    """Runs in the subprocess: load, synchronize, report seconds and peak host memory."""
    start = time.perf_counter()
    if engine == "dyngen":
        from dyngen_core import Model

        Model.load(folder, device=device, dtype="bfloat16")
    else:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "peak_rss_gb": peak_rss / 1e9}


def measure(engine: str, folder: Path, device: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--load", engine, "--dir", str(folder),
                          "--device", device], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--dir", default="/tmp/dyngen-load", help="where to write the checkpoint")
    parser.add_argument("--load", choices=["dyngen", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    args = parser.parse_args()
    folder = Path(args.dir)
    if args.load:
        print(json.dumps(load_once(args.load, folder, args.device)))
        return
    device = torch.device(args.device)
    config = bench_config(args)
    written = write_checkpoint(folder, config, device)
    print(f"{device_name()}: wrote {written / 1e9:.2f} GB of bf16 safetensors to {folder}")
    engines = ["dyngen"] + ([] if args.no_hf else ["transformers"])
    try:
        results = {engine: measure(engine, folder, args.device) for engine in engines}
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    for engine, result in results.items():
        rate = written / 1e9 / result["seconds"]
        report(f"load_{engine}", seconds=round(result["seconds"], 2), gb_per_s=round(rate, 2),
               peak_host_rss_gb=round(result["peak_rss_gb"], 2))
    if "transformers" in results:
        ratio = results["transformers"]["seconds"] / results["dyngen"]["seconds"]
        report("load_ratio", dyngen_faster_by=round(ratio, 2))


if __name__ == "__main__":
    main()
