"""Run `tpdiag compare` over every transformers causal-LM architecture that has a TP plan.

    python examples/hf_zoo.py --work /tmp/zoo                 # all, resumable
    python examples/hf_zoo.py --work /tmp/zoo --only llama,qwen3_moe
    python examples/hf_zoo.py --work /tmp/zoo --table docs/models-zoo.md   # rewrite the table only

Architectures: every model type of transformers' causal-LM auto mapping whose config class has a
`base_model_tp_plan`. Each gets a tiny random config (2 layers, hidden 64, 4 heads of 16, vocab
128, 4 experts top-2 where it is an MoE; only keys its config class knows are set), written as a
config-only `hf:DIR` (tpdiag's seeded random init), and one compare at TP=1,2 - and 4 where the
heads allow - with a per-model time limit. Results go to WORK/results.jsonl as they come (a rerun
skips what is there); `--table FILE` writes the markdown table between the zoo markers of FILE.
Only what actually ran is in the table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- zoo:begin -->", "<!-- zoo:end -->"

# Applied where the config class has the key (its default instance's to_dict()).
TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 128,
    "max_position_embeddings": 256, "use_cache": False, "attention_dropout": 0.0,
    "hidden_dropout": 0.0, "dropout": 0.0,
    # MoE
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "experts_per_token": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
    "decoder_sparse_step": 1, "moe_layer_freq": 1,
    "ffn_hidden_size": 128, "expert_ffn_hidden_size": 64, "zero_expert_num": 1,  # longcat_flash
    "num_experts_per_token": 2, "num_expert_group": 1, "linear_head_dim": 16,   # kimi_linear,
    "linear_num_heads": 4,                                                      # bailing_hybrid
    "moe_topk": 2,                                                              # longcat_flash
    "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16,       # gemma3n/gemma4
    # MLA (deepseek-style attention)
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": 64,
}


# Per-architecture keys where the generic tiny config does not build (each seen failing at TP=1).
OVERRIDES = {
    # GPT-J-style names (its plan is new in transformers 5.24); rotary_dim within head_dim 16
    "codegen": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "n_ctx": 256,
                "rotary_dim": 8, "n_inner": 128},
    "gptj": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "rotary_dim": 8,
             "n_inner": 128},
    "mimo_v2_flash": {"num_key_value_heads": 2},  # its sliding-window layers double the kv heads
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},  # default: None
    "cohere_compass_text": {  # rope parameters are looked up per layer type
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "olmo_hybrid": {"layer_types": ["linear_attention", "full_attention"],  # needs one attention
                    "linear_num_key_heads": 4, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                    "linear_value_head_dim": 16},
    "gemma3n_text": {"num_kv_shared_layers": 0, "laurel_rank": 8},
}


# What a row that is not a clean result is, as investigated (docs/models-zoo.md, zoo notes).
NOTES: dict[str, str] = {
    "apertus": "transformers 5.24: tpdiag's meta-device build refuses it - XIELU's alpha_p/alpha_n "
               "are set only in the activation's __init__ and no _init_weights rule fills them (not "
               "fixed yet). 5.23: real finding: XIELU's replicated alpha_p/alpha_n get each rank's partial grad "
               "(its own ffn columns) and the plan never all-reduces them; the ranks' copies add up "
               "to TP=1's grad, and one step later the replicas differ by 0.02",
    "apertus1p5_text": "transformers 5.24: as apertus, tpdiag's meta-device build refuses it (XIELU's "
                       "alpha_p/alpha_n filled by no init rule; not fixed yet)",
    "deepseek_v3": "TP=4: SiLU on each rank's 16-column strided gate shard runs the scalar tail of "
                   "torch's AVX-512 kernel (1-2 ULP): shape-dependent-kernel",
    "afmoe": "TP=4: SiLU on each rank's 16-column strided gate shard runs the scalar tail of "
             "torch's AVX-512 kernel (1-2 ULP): shape-dependent-kernel",
    "inkling2_text": "transformers plan bug: the packed experts.gate_up_proj is cut 'colwise' "
                     "(contiguous halves), not 'packed_colwise': rank 0 holds only gate rows, rank 1 "
                     "only up rows, so chunk(2) pairs gate with gate (the act_fn inputs are bitwise "
                     "TP=1's wrong columns); the wrong op is in the experts' unprobed code, so "
                     "module granularity cannot bound it",
    "inkling2_loop_text": "the inkling2 text model with looped layers: the same transformers plan bug as "
                          "inkling2_text (experts.gate_up_proj cut 'colwise', not 'packed_colwise')",
    "inkling_text": "transformers bug: embed_tokens gets the default 'embedding_rowwise', but "
                    "InklingNormedEmbedding runs its RMSNorm inside forward, on the vocab-parallel "
                    "partial sums; DTensor asserts in the Partial reduction (inkling2's plan says "
                    "'replicate')",
    "doge": "tpdiag's plan (transformers' dt_proj 'rowwise' returned the dynamic mask for every kv "
            "head while attention held the rank's local heads: an SDPA shape error): dt_proj gathers "
            "its input and keeps the local heads' columns, its first difference a column-parallel "
            "GEMM the float64 oracle judges rounding",
    "gpt_oss": "tpdiag's plan (transformers 5.24's splits only the embedding): heads, sinks, "
               "interleaved gate/up experts, down_proj_bias added once",
    "llama4_text": "transformers bug under autograd: the MoE adds the routed output into the shared "
                   "expert's output in place (out.add_), a row-parallel to_local() view at TP > 1; "
                   "runs only without grad",
    "llama4": "the same text model as llama4_text (composite config, text part built)",
    "longcat_flash": "zero experts (moe_identity_expert: input / TP, summed by moe_tp_experts) are "
                     "recorded as partials; read as replicas they were a false sharding-bug",
    "bailing_hybrid": "TP=4: SiLU on each rank's 16-column strided gate shard (scalar tail of the "
                      "AVX-512 kernel, 2 ULP): shape-dependent-kernel",
    "axk2": "MLA (fixed, as deepseek_v2). TP=4: a 2-ULP difference enters in self_attn's own code "
            "before a child module; not bounded at module granularity (--granularity op names the op)",
    "dots3_note_text": "MLA (fixed). The rope-only norm between kv_a_proj and attention carries "
                       "each rank's partial rope grad (reduced in kv_a_proj's style): now an "
                       "unreduced partial, not a replica finding",
    "gemma4_text": "its plan's 'layers.*.experts' entries name nothing in a model without MoE; "
                   "tpdiag had folded them onto the layer as a parameter (a false plan overlap)",
}
for _mla in ("deepseek_v2", "deepseek_v32", "axk2", "dots3_note_text", "glm4_moe_lite", "glm_moe_dsa",
             "hy_v4", "longcat_flash", "minicpm3"):
    NOTES.setdefault(_mla, "MLA: mla_kv_a_proj gets the model config, its output grad (rope columns "
                           "reduced inside the style's backward) is recorded as a partial")


def architectures() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            cls = CONFIG_MAPPING[mt]
        except (KeyError, ValueError, ImportError):
            continue
        plan = getattr(cls, "base_model_tp_plan", None) or {}
        # transformers 5.24 gives many configs an embedding-only plan: that splits no layer, and
        # tpdiag refuses it (docs/models.md) unless it carries its own plan for the type
        if [k for k in plan if "embed" not in k] or mt in TPDIAG_PLANS:
            out.append(mt)
    return out + [m for m in SUPPLIED if m not in out]


# Architectures whose tiny config comes from examples/make_tiny_hf.py (gpt_oss: attention sinks,
# sliding-window layers and biases switched on); their plan is tpdiag's (tpdiag/models/plans_hf.py).
SUPPLIED = ("gpt_oss",)
# Model types that run on tpdiag's own plan with the transformers this table ran (docs/models.md,
# "tpdiag's own plans"), so their rows say so.
TPDIAG_PLANS = ("gpt_oss", "doge")


def _make_tiny():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tpdiag_example_make_tiny_hf", os.path.join(ROOT, "examples", "make_tiny_hf.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_config(model_type: str, out_dir: str) -> dict:
    """Write out_dir/config.json; returns the head counts a degree must divide."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type in SUPPLIED:
        cfg = _make_tiny().CONFIGS[model_type]
        _make_tiny().write_tiny(model_type, out_dir)
        return {k: cfg[k] for k in ("num_attention_heads", "num_key_value_heads")}
    cls = CONFIG_MAPPING[model_type]
    kw = {**_tiny_kw(cls), **OVERRIDES.get(model_type, {})}
    # composite configs (llama4: text + vision, phi4_multimodal: audio + vision): every part
    # tiny, or the default vision/audio towers alone are ~1B parameters per rank
    for key, sub in (getattr(cls, "sub_configs", None) or {}).items():
        if isinstance(sub, type):
            try:
                kw[key] = _tiny_kw(sub)
            except Exception:  # noqa: BLE001 - a part that cannot be built alone keeps its defaults
                pass
    cfg = cls(**kw)
    os.makedirs(out_dir, exist_ok=True)
    cfg.save_pretrained(out_dir)
    tc = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return {k: getattr(tc, k) for k in ("num_attention_heads", "num_key_value_heads")
            if isinstance(getattr(tc, k, None), int)}


def _tiny_kw(cls) -> dict:
    """TINY's keys that this config class knows, with its special tokens inside the vocab."""
    defaults = cls().to_dict()
    kw = {k: v for k, v in TINY.items() if k in defaults}
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        v = defaults.get(key)
        if isinstance(v, int) and v >= TINY["vocab_size"]:
            kw[key] = 0  # a special token id past the tiny vocab (an embedding padding_idx assert)
    if "qk_rope_head_dim" in kw and "head_dim" in kw:
        kw["head_dim"] = kw["qk_rope_head_dim"]  # MLA: the rotary part is the head_dim rope sees
    lt = defaults.get("layer_types")
    if isinstance(lt, list) and lt:
        kw["layer_types"] = (lt * 2)[: TINY["num_hidden_layers"]]
    return kw


# A "tiny" config that still builds a big model (a part whose size TINY's keys do not reach)
# is not run: 4 ranks of it could exhaust the shared machine's memory.
MAX_PARAMS = 20_000_000


def param_count(out_dir: str) -> int:
    """Parameters of the causal LM the config in out_dir builds (on the meta device: no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(out_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def degrees_for(heads: dict) -> list[int]:
    out = [1, 2]
    if all(v % 4 == 0 for v in heads.values()):
        out.append(4)
    return out


def run_one(model_type: str, work: str, limit: float, max_degree: int = 4,
            extra: tuple = ()) -> dict:
    mdir = os.path.join(work, "models", model_type)
    rdir = os.path.join(work, "runs", model_type)
    row = {"model_type": model_type, "commit": _commit()}
    try:
        heads = tiny_config(model_type, mdir)
    except Exception as e:  # noqa: BLE001 - any config failure is a row of the table
        row.update(result="config-error", detail=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return row
    try:
        n = param_count(mdir)
    except Exception as e:  # noqa: BLE001 - the compare reports an unbuildable model in its words
        n = None
        row["param_count_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    if n is not None:
        row["params"] = n
        if n > MAX_PARAMS:
            row.update(result="config-error", detail=f"the tiny config still builds {n / 1e6:.0f}M "
                       f"parameters (limit {MAX_PARAMS / 1e6:.0f}M): some part keeps its full size")
            return row
    degs = [d for d in degrees_for(heads) if d <= max_degree]
    row["degrees"] = degs
    shutil.rmtree(rdir, ignore_errors=True)  # never read an older run's summary
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.time()
    # limit 0: no limit (a world still needs some timeout: a day stands for none)
    world_limit = limit if limit > 0 else 86400.0
    try:
        p = subprocess.run([sys.executable, "-m", "tpdiag.cli", "compare", "--model", f"hf:{mdir}",
                            "--tp", ",".join(map(str, degs)), "--out", rdir, "--no-confirm",
                            "--format", "json", "--timeout", str(int(world_limit)), *extra],
                           capture_output=True, text=True, cwd=ROOT, env=env,
                           timeout=world_limit + 60)
    except subprocess.TimeoutExpired:
        row.update(result="timeout", detail=f"over {limit:.0f} s", seconds=round(time.time() - t0))
        return row
    row["seconds"] = round(time.time() - t0, 1)
    row["exit"] = p.returncode
    if read_summary(row, rdir):
        return row
    os.makedirs(rdir, exist_ok=True)
    with open(os.path.join(rdir, "stderr.txt"), "w") as f:
        f.write(p.stderr + p.stdout)
    row.update(result="error", detail=_error_line(p.stderr + "\n" + p.stdout, p.returncode))
    return row


def _commit() -> str:
    """The commit the row ran at (TPDIAG_GIT_COMMIT wins, as in tpdiag's manifest)."""
    env = os.environ.get("TPDIAG_GIT_COMMIT")
    if env:
        return env[:7]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=ROOT, timeout=10)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def read_summary(row: dict, rdir: str) -> bool:
    """Fill row from rdir/summary.json (an inconclusive run writes one too, with its error)."""
    summ = os.path.join(rdir, "summary.json")
    if not os.path.exists(summ):
        return False
    with open(summ) as f:
        s = json.load(f)
    row["result"] = s["status"]
    if s.get("error"):
        row["detail"] = s["error"][:220]
    per = {}
    for label, d in s.get("degrees", {}).items():
        fd = d.get("first_divergence") or {}
        per[label] = {"status": d.get("status"), "module": fd.get("module"), "cause": fd.get("cause"),
                      "findings": sorted({x["cause"] for x in d.get("findings", [])}),
                      "error": (d.get("error") or "")[:200]}
    row["per_degree"] = per
    return True


def _error_line(text: str, code: int) -> str:
    """tpdiag's one-line error, else the exception line of a traceback (a tpdiag bug: errors
    should be one line), else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if ln.lower().startswith("error"):
            return ln[:220]
    exc = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*:", ln)]
    if exc:
        return f"traceback: {exc[-1][:200]}"
    return (lines[-1] if lines else f"exit {code}")[:220]


def _cell(row: dict, label: str) -> str:
    d = row.get("per_degree", {}).get(label)
    if d is None:
        return "-"
    if d["status"] == "bitwise":
        return "bitwise"
    if d["status"] == "failed":
        return f"failed: {d.get('error', '')}".replace("|", "/")
    s = f"{d['status']}: {d['cause']} at `{d['module']}`"
    if d["findings"]:
        s += f"; findings: {', '.join(d['findings'])}"
    return s


def table(rows: list[dict], meta: str) -> str:
    out = [meta, "", "| architecture | result | TP=2 | TP=4 | what it is | commit | wall s (whole compare, "
                     "shared machine) |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["model_type"]):
        res = r["result"]
        note = NOTES.get(r["model_type"], "").replace("|", "/")
        tail = f"| {note} | {r.get('commit', '?')} | {r.get('seconds', '')} |"
        if r["model_type"] in TPDIAG_PLANS:
            r = {**r, "model_type": f"{r['model_type']} (tpdiag's plan: models/plans_hf.py)"}
        if res in ("error", "config-error", "timeout", "inconclusive"):
            detail = r.get("detail") or next((f"TP={k} {d['status']}: {d['error']}" for k, d in
                                              r.get("per_degree", {}).items() if d.get("error")), "")
            out.append(f"| {r['model_type']} | {res} | {detail.replace('|', '/')} | {tail}")
            continue
        t4 = _cell(r, "4") if 4 in r.get("degrees", []) else "(heads)"
        out.append(f"| {r['model_type']} | {res} | {_cell(r, '2')} | {t4} {tail}")
    return "\n".join(out) + "\n"


def write_table(path: str, rows: list[dict], meta: str) -> None:
    with open(path) as f:
        text = f.read()
    block = f"{BEGIN}\n{table(rows, meta)}{END}"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def load_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="models, runs and results.jsonl go here")
    ap.add_argument("--only", default="", help="comma-separated model types (default: all)")
    ap.add_argument("--limit", type=float, default=240.0, help="seconds per model (0: none)")
    ap.add_argument("--table", default="", help="write the markdown table into this file")
    ap.add_argument("--no-run", action="store_true", help="only write the table from results")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    res_path = os.path.join(args.work, "results.jsonl")
    rows = load_rows(res_path)
    done = {r["model_type"] for r in rows}
    if not args.no_run:
        todo = [m for m in (args.only.split(",") if args.only else architectures()) if m not in done]
        for mt in todo:
            row = run_one(mt, args.work, args.limit)
            print(json.dumps(row), flush=True)
            with open(res_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            rows.append(row)
    if args.table:
        import torch
        import transformers

        limit = f"per-model limit {args.limit:.0f} s" if args.limit > 0 else "no per-model limit"
        meta = (f"Ran {time.strftime('%Y-%m-%d', time.gmtime(os.path.getmtime(res_path)))} with "
                f"`examples/hf_zoo.py`: torch {torch.__version__}, transformers "
                f"{transformers.__version__}, CPU gloo fp32, {platform.machine()} "
                f"({os.cpu_count()} cores, shared), {limit}; each row at the commit it names.")
        write_table(args.table, rows, meta)


if __name__ == "__main__":
    main()
