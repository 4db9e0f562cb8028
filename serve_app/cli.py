"""`kimi-dspark`: command-line tools of the Serve app.

- `inspect PATH`: validate a DSpark checkpoint folder from its safetensors headers alone.
- `demo`: serve the embedded CPU default and stream one answer with its acceptance stats.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from serve_app.models.checkpoint import CheckpointError, check_against, read_index
from serve_app.models.dspark_config import DSparkConfig, DSparkConfigError

_BITS = (16, 8, 4)


def inspect_checkpoint(path: str | Path) -> dict[str, Any]:
    """Validate a DSpark checkpoint without reading weights; raises on any problem."""
    path = Path(path)
    config = DSparkConfig.from_file(path)
    from serve_app.models.dspark import expected_tensors  # torch import only when needed

    infos = read_index(path)
    expected = expected_tensors(config)
    _, problems = check_against(infos, expected)
    if problems:
        raise CheckpointError(path, problems)
    params = sum(info.numel for info in infos.values())
    dtypes = sorted({info.dtype for info in infos.values()})
    return {
        "path": str(path),
        "files": sorted({info.file.name for info in infos.values()}),
        "tensors": len(infos),
        "parameters": params,
        "dtype": "/".join(dtypes),
        "target_layer_ids": list(config.target_layer_ids),
        "num_target_layers": config.num_target_layers,
        "block_size": config.block_size,
        "verify_width": config.block_size + 1,
        "markov_head": config.markov_head_type if config.has_markov else "none",
        "markov_rank": config.markov_rank,
        "confidence_head": config.enable_confidence_head,
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "attention": f"{config.num_attention_heads} q heads / {config.num_key_value_heads} kv "
        f"heads x {config.head_dim}",
        "mask_token_id": config.mask_token_id,
        "memory_bytes": {f"{bits}-bit": math.ceil(params * bits / 8) for bits in _BITS},
    }


def _print_report(report: dict[str, Any]) -> None:
    rows = [
        ("checkpoint", report["path"]),
        ("files", ", ".join(report["files"])),
        ("tensors", str(report["tensors"])),
        ("parameters", f"{report['parameters']:,}"),
        ("dtype", report["dtype"]),
        ("draft layers", f"{report['layers']} x hidden {report['hidden_size']}, "
                         f"{report['attention']}"),
        ("tapped target layers", f"{report['target_layer_ids']} of {report['num_target_layers']}"),
        ("block size (gamma)", f"{report['block_size']} drafts, verify width "
                               f"{report['verify_width']}"),
        ("markov head", f"{report['markov_head']}, rank {report['markov_rank']}"),
        ("confidence head", "yes" if report["confidence_head"] else "no"),
        ("mask token id", str(report["mask_token_id"])),
    ]
    rows += [(f"weights at {k}", f"{v / 1e9:.2f} GB ({v / 2**30:.2f} GiB)")
             for k, v in report["memory_bytes"].items()]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def _cmd_inspect(args: argparse.Namespace) -> int:
    report = inspect_checkpoint(args.path)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from serve_app.demo import run_demo

    return run_demo(args.max_tokens, args.port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kimi-dspark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="validate a DSpark checkpoint folder (headers only)")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_inspect)
    p = sub.add_parser("demo", help="serve deployments/local.yaml and stream a K3 conversation "
                       "(reasoning, answer, a required tool call) with acceptance statistics")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--port", type=int, help="HTTP port (default: the deployment file's)")
    p.set_defaults(func=_cmd_demo)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, DSparkConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
