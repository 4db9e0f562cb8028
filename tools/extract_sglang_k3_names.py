"""Extract the checkpoint tensor names SGLang's Kimi K3 loader accepts, without importing SGLang.

    python tools/extract_sglang_k3_names.py /path/to/site-packages/sglang \
        -o tests/data/sglang_k3_names_0_5_23.json

SGLang cannot be imported on CPU-only machines, yet our K3 tensor table
(`serve_app/models/k3_config.py`) must name exactly what `sglang/srt/models/kimi_k3.py` loads.
This script parses `srt/models/kimi_k3.py` (and `srt/models/deepseek_v2.py` for the two classes
K3 inherits or reuses: `DeepseekV2AttentionMLA`, `MoEGate`) with `ast` and writes:

* `kinds`: per layer kind (`layer`/`attn_res` from `KimiK3DecoderLayer`, `kda`
  `KimiK3DeltaAttention`, `mla` `KimiK3MLAAttention` + its base's `__init__`, `moe`
  `KimiK3MoE`, `dense_mlp` `KimiK3MLP`, `top` `KimiK3LinearModel` + `KimiK3LinearForCausalLM`),
  every parameter the module's `__init__` registers: `self.X = <Linear|RMSNorm|Embedding|
  LMHead>(...)` gives `X.weight`, `self.X = nn.Parameter(...)` gives `X`, submodules of known
  K3 classes (`KimiK3MLP`, `MoEGate`) are expanded with their prefix, and the routed experts
  (`get_moe_impl_class(...)(...)`) give FusedMoE's `experts.w13_weight` / `experts.w2_weight`.
  Each entry carries the source of the `if` tests (and `x if cond else None`) guarding it,
  with the branch taken (`value`), the line, and its checkpoint-side names: the runtime param
  undone through `stacked_params_mapping` (e.g. `gate_up_proj` <- `gate_proj`, `up_proj`),
  the `name.replace(a, b)` fusions of `load_weights` (MLA `q_a_proj` + `kv_a_proj_with_mqa` ->
  `fused_qkv_a_proj_with_mqa`) and the expert mapping (`experts.{e}.w1.weight`, `{e}` being
  the expert id).
* `stacked_params_mapping`, `expert_params_mapping` (the `make_expert_params_mapping` keyword
  names and the `_EXPERT_WEIGHT_NAME` regex), `rewrites` (every `x.replace("a", "b")` with
  literal arguments in both `load_weights` plus the `hf_to_sglang_mapper` prefix/substring
  maps) and `skips` (`if "s" in name: continue` substrings), each with its line.

Limits: conditions are kept as source text, not evaluated (the test maps each to a config
field; runtime ones such as `do_fuse_qkvbfg` or pipeline ranks it sets itself). `del self.X`
(the GGUF split-KV branch of MLA) is not modelled; its replacement params carry the
`split_gguf_kv_b` condition. Modules built by unknown constructors (e.g. DSA `Indexer`) are
listed under `unmodelled`, not expanded. FusedMoE's own params are named here, not read from
its file. Quantization scale tensors (`weight_scale`, `weight_scale_inv`, ...) are not listed:
they come from quant methods, not from kimi_k3.py. Unknown checkpoint names are dropped
silently by the loader (`if name not in params_dict: continue`), so the `kinds` lists are
what SGLang *requires*; anything else is ignored, not refused.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

VERSION = "0.5.23"
LEAF_MODULES = {
    "ReplicatedLinear", "ColumnParallelLinear", "RowParallelLinear", "MergedColumnParallelLinear",
    "QKVParallelLinear", "MergedColumnParallelRepeatedLinear", "RMSNorm", "FusedRMSNormGated",
    "VocabParallelEmbedding", "ParallelLMHead",
}
# Leaves whose parameter is not `weight`: ColumnParallelBatchedLinear keeps `weight` too.
LEAF_MODULES |= {"ColumnParallelBatchedLinear"}
EXPANDED = {"KimiK3MLP": "dense_mlp", "MoEGate": "moe_gate"}
KINDS = {  # kind -> (file, classes whose __init__ are read, in order)
    "dense_mlp": ("kimi_k3.py", ["KimiK3MLP"]),
    "moe_gate": ("deepseek_v2.py", ["MoEGate"]),
    "moe": ("kimi_k3.py", ["KimiK3MoE"]),
    "kda": ("kimi_k3.py", ["KimiK3DeltaAttention"]),
    "mla": ("kimi_k3.py", ["KimiK3MLAAttention"]),
    "mla_base": ("deepseek_v2.py", ["DeepseekV2AttentionMLA"]),
    "decoder": ("kimi_k3.py", ["KimiK3DecoderLayer"]),
    "top": ("kimi_k3.py", ["KimiK3LinearModel", "KimiK3LinearForCausalLM"]),
}
SUBLAYER = {"KimiK3DeltaAttention": "kda", "KimiK3MLAAttention": "mla", "KimiK3MoE": "moe",
            "KimiK3MLP": "dense_mlp"}


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise KeyError(f"{cls.name}.{name}")


def _call_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Call):  # get_moe_impl_class(...)(...)
            inner = _call_name(func)
            return f"{inner}()" if inner else None
        if isinstance(func, ast.Name):
            return func.id
        if isinstance(func, ast.Attribute):
            return func.attr if not isinstance(func.value, ast.Name) or func.value.id != "nn" \
                else f"nn.{func.attr}"
    return None


def _walk(stmts: list[ast.stmt], conds: list[dict[str, Any]], out: list[dict[str, Any]]) -> None:
    """Every `self.X = Call(...)` / `self.register_parameter(...)` with its guarding tests."""
    for stmt in stmts:
        if isinstance(stmt, ast.If):
            test = {"test": ast.unparse(stmt.test)}
            _walk(stmt.body, [*conds, {**test, "value": True}], out)
            _walk(stmt.orelse, [*conds, {**test, "value": False}], out)
            continue
        if isinstance(stmt, ast.For | ast.With | ast.Try):
            _walk(stmt.body, conds, out)
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(
                stmt.value.func, ast.Attribute) and stmt.value.func.attr == "register_parameter":
            arg = stmt.value.args[0]
            name = arg.value if isinstance(arg, ast.Constant) else ast.unparse(arg)
            out.append({"attr": name, "ctor": "nn.Parameter", "when": conds,
                        "line": stmt.lineno})
            continue
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
            continue
        target = stmt.targets[0]
        if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                and target.value.id == "self"):
            continue
        value, when = stmt.value, conds
        if isinstance(value, ast.IfExp):
            when = [*conds, {"test": ast.unparse(value.test), "value": True}]
            value = value.body
        ctor = _call_name(value)
        if ctor:
            out.append({"attr": target.attr, "ctor": ctor, "when": when, "line": stmt.lineno})


def _literal_list(node: ast.expr, named: dict[str, list[Any]]) -> list[Any]:
    items: list[Any] = []
    for elt in node.elts if isinstance(node, ast.List) else []:
        if isinstance(elt, ast.Starred) and isinstance(elt.value, ast.Name):
            items.extend(named.get(elt.value.id, []))
        else:
            items.append([*ast.literal_eval(elt), elt.lineno])
    return items


def _load_weights_facts(fn: ast.FunctionDef) -> dict[str, Any]:
    named: dict[str, list[Any]] = {}
    expert: dict[str, Any] = {}
    rewrites: list[dict[str, Any]] = []
    skips: list[dict[str, Any]] = []
    for node in sorted((n for n in ast.walk(fn) if hasattr(n, "lineno")),
                       key=lambda n: (n.lineno, n.col_offset)):  # source order
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                node.targets[0], ast.Name) and isinstance(node.value, ast.List):
            key = node.targets[0].id
            named[key] = named.get(key, []) + _literal_list(node.value, named)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "make_expert_params_mapping":
                expert = {k.arg: k.value.value for k in node.keywords
                          if isinstance(k.value, ast.Constant)}
                expert["line"] = node.lineno
            if node.func.attr == "replace" and len(node.args) == 2 and all(
                    isinstance(a, ast.Constant) for a in node.args):
                rewrites.append({"from": node.args[0].value, "to": node.args[1].value,
                                 "line": node.lineno})
        if isinstance(node, ast.If) and node.body and isinstance(node.body[0], ast.Continue):
            for sub in ast.walk(node.test):
                if isinstance(sub, ast.Compare) and isinstance(sub.left, ast.Constant) and \
                        isinstance(sub.ops[0], ast.In) and isinstance(sub.comparators[0],
                                                                      ast.Name):
                    skips.append({"substring": sub.left.value, "line": node.lineno})
    return {"named": named, "expert": expert, "rewrites": rewrites, "skips": skips}


def _checkpoint(param: str, stacked: list[list[Any]], rewrites: list[dict[str, Any]]) -> list[str]:
    module, _, leaf = param.rpartition(".")
    if not module:
        return [param]
    last = module.rpartition(".")[2]
    head = module[: len(module) - len(last)]
    names = [f"{head}{w.lstrip('.')}.{leaf}" for p, w, _s, _l in stacked if p == f".{last}"]
    names += [f"{head}{r['from'].strip('.')}.{leaf}" for r in rewrites
              if r["to"] == f".{last}." and r["from"] != r["to"]]
    return names or [param]


def extract(src: Path) -> dict[str, Any]:
    src = Path(src)
    models = src / "srt" / "models"
    trees = {f: ast.parse((models / f).read_text()) for f in ("kimi_k3.py", "deepseek_v2.py")}
    classes = {f: _classes(t) for f, t in trees.items()}
    raw: dict[str, list[dict[str, Any]]] = {}
    for kind, (file, names) in KINDS.items():
        raw[kind] = []
        for name in names:
            entries: list[dict[str, Any]] = []
            _walk(_method(classes[file][name], "__init__").body, [], entries)
            if name == "KimiK3LinearModel":
                entries = [{**e, "attr": f"model.{e['attr']}"} for e in entries]
            raw[kind] += [{**e, "file": file} for e in entries]
    causal = classes["kimi_k3.py"]["KimiK3LinearForCausalLM"]
    facts = _load_weights_facts(_method(causal, "load_weights"))
    wrapper = classes["kimi_k3.py"]["KimiK3ForConditionalGeneration"]
    wrap_facts = _load_weights_facts(_method(wrapper, "load_weights"))
    stacked = facts["named"]["stacked_params_mapping"]
    rewrites = facts["rewrites"] + wrap_facts["rewrites"]
    for node in wrapper.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "hf_to_sglang_mapper":
            for kw in node.value.keywords:
                for a, b in ast.literal_eval(kw.value).items():
                    rewrites.append({"from": a, "to": b, "line": node.lineno,
                                     "kind": f"hf_to_sglang_mapper.{kw.arg}"})
    expert = facts["expert"]
    unmodelled: list[dict[str, Any]] = []

    def params(kind: str, prefix: str = "", when: list[Any] | None = None) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for e in raw[kind]:
            cond = [*(when or []), *e["when"]]
            attr, ctor = prefix + e["attr"], e["ctor"]
            where = {"file": e["file"], "line": e["line"]}
            if kind == "decoder" and ctor in SUBLAYER:
                continue  # the attention / FFN sublayers: their own kinds
            if ctor in LEAF_MODULES:
                rows.append({"param": f"{attr}.weight", "when": cond, **where})
            elif ctor == "nn.Parameter":
                rows.append({"param": attr, "when": cond, **where})
            elif ctor in EXPANDED:
                rows += params(EXPANDED[ctor], f"{attr}.", cond)
            elif ctor == "get_moe_impl_class()":
                for param, ckpts in (("w13_weight", (expert["ckpt_gate_proj_name"],
                                                     expert["ckpt_up_proj_name"])),
                                     ("w2_weight", (expert["ckpt_down_proj_name"],))):
                    rows.append({"param": f"{attr}.{param}", "when": cond, **where,
                                 "checkpoint": [f"{attr}.{{e}}.{w}.weight" for w in ckpts]})
            elif ctor not in SUBLAYER and ctor[:1].isupper() and ctor != "PPMissingLayer":
                unmodelled.append({"kind": kind, "attr": attr, "ctor": ctor, **where})
        for row in rows:
            row.setdefault("checkpoint", _checkpoint(row["param"], stacked, rewrites))
        return rows

    decoder = raw["decoder"]
    sub_prefix = {SUBLAYER[e["ctor"]]: e["attr"] + "." for e in decoder if e["ctor"] in SUBLAYER}
    kinds = {"kda": params("kda"), "mla": params("mla") + params("mla_base"),
             "moe": params("moe"), "dense_mlp": params("dense_mlp")}
    layer = params("decoder")
    kinds["attn_res"] = [r for r in layer if any("attn_res" in c["test"] for c in r["when"])]
    kinds["layer"] = [r for r in layer if r not in kinds["attn_res"]]
    kinds["top"] = params("top")
    return {
        "sglang_version": VERSION,
        "source": "sglang/srt/models/kimi_k3.py (+ deepseek_v2.py: DeepseekV2AttentionMLA, "
                  "MoEGate)",
        "prefixes": {**sub_prefix, "layer": "", "attn_res": "", "top": ""},
        "kinds": kinds,
        "stacked_params_mapping": [dict(zip(("param", "checkpoint", "shard", "line"), s,
                                            strict=True)) for s in stacked],
        "expert_params_mapping": {**expert, "regex": _expert_regex(trees["kimi_k3.py"])},
        "rewrites": rewrites,
        "skips": facts["skips"] + wrap_facts["skips"],
        "unmodelled": unmodelled,
    }


def _expert_regex(tree: ast.Module) -> str | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "_EXPERT_WEIGHT_NAME":
            return node.value.args[0].value
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="the unpacked wheel's sglang/ directory")
    parser.add_argument("-o", "--output", type=Path, help="write here (default: stdout)")
    args = parser.parse_args(argv)
    text = json.dumps(extract(args.src), indent=1) + "\n"
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
