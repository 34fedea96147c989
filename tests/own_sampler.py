"""An RL team's own sampler as the rollout engine, shared by the rollout tests of `py:` policies with
their own KV cache (`new_kv_cache()`, `forward(ids, cache=...)`): the policy as tpdiag builds it
(seeded 1234), one prompt per call through its cache, each sampled token's float32 log-softmax
(raw, T = 1), written as tpdiag's JSONL."""
import importlib.util
import json

import torch


def user_module(file: str, name: str = "own_sampler_user"):
    """The user's file, imported as tpdiag's py: loader reads it (by path)."""
    spec = importlib.util.spec_from_file_location(name, file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sample(file: str, factory: str, path, prompts=(4, 6, 5), new: int = 6, temperature: float = 1.0) -> str:
    """Prompts of these lengths (seed 3), `new` tokens each, into `path`; its path as a str. A
    temperature T samples from and reports log_softmax(float32 logits / T)."""
    mod = user_module(file)
    torch.manual_seed(1234)
    model = getattr(mod, factory)().model.eval()
    g = torch.Generator().manual_seed(3)
    lines = []
    with torch.no_grad():
        for n in prompts:
            ids = torch.randint(0, mod.VOCAB, (1, n), generator=g)
            cache = model.new_kv_cache()
            logits = model(ids, cache=cache)[:, -1]
            seq, lps = ids[0].tolist(), []
            for _ in range(new):
                lp = (logits.float() / temperature).log_softmax(-1) if temperature != 1.0 else logits.float().log_softmax(-1)
                t = int(torch.multinomial(lp.exp(), 1, generator=g))
                seq.append(t)
                lps.append(lp[0, t].item())
                logits = model(torch.tensor([[t]]), cache=cache)[:, -1]
            lines.append(json.dumps({"input_ids": seq, "prompt_len": n, "logprobs": lps}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)
