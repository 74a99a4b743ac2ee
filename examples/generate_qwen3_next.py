#!/usr/bin/env python3
"""Greedy generation with a tiny, randomly initialised Hugging Face Qwen3-Next (or Qwen3.5) whose GDN layers run on gdn.

The model is built from a config (nothing is downloaded): ``--layers`` decoder layers alternating linear attention
(GDN) and full attention. It generates greedily twice, once with transformers' own GDN code and once with
``gdn.integrations.transformers.enable()``, and compares the tokens and the prompt logits.

    python examples/generate_qwen3_next.py                       # CPU: gdn's torch path (or the Triton interpreter
                                                                 #      with TRITON_INTERPRET=1)
    python examples/generate_qwen3_next.py --device cuda --dtype bfloat16 --hidden 512 --new-tokens 64
    python examples/generate_qwen3_next.py --model qwen3_5
"""
from __future__ import annotations

import argparse
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["qwen3_next", "qwen3_5"], default="qwen3_next")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build(args):
    import torch

    common = dict(vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=args.hidden // 4, linear_conv_kernel_dim=4, linear_key_head_dim=args.hidden // 4,
                  linear_value_head_dim=args.hidden // 4, linear_num_key_heads=2, linear_num_value_heads=4,
                  layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(args.layers)],
                  max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if args.model == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=args.hidden,
                              shared_expert_intermediate_size=args.hidden, **common)
        model = Qwen3NextForCausalLM(cfg)
    else:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common))
    return model.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers

    import gdn.integrations.transformers as gdn_hf
    from gdn.backend import backend_name, use_triton
    from gdn.testing import rel_err

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    model = build(args)
    ids = torch.randint(3, 256, (args.batch_size, args.prompt_len), device=args.device)
    path = "triton" if use_triton(torch.device(args.device)) else "torch"
    print(f"{args.model} ({args.layers} layers, hidden {args.hidden}, {args.dtype}) on {args.device}, "
          f"transformers {transformers.__version__}, gdn backend {backend_name()} -> {path}")

    def run():
        with torch.no_grad():
            logits = model(ids).logits.float()
            t0 = time.time()
            out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, min_new_tokens=args.new_tokens)
            return logits, out[:, args.prompt_len:], time.time() - t0

    logits_hf, gen_hf, t_hf = run()
    with gdn_hf.enabled():
        logits_gdn, gen_gdn, t_gdn = run()
    for name, gen, t in (("transformers", gen_hf, t_hf), ("gdn", gen_gdn, t_gdn)):
        print(f"{name:>12}: {gen[0].tolist()}  ({t:.2f}s)")
    same = torch.equal(gen_hf, gen_gdn)
    err = rel_err(logits_gdn, logits_hf)
    print(f"prompt logits rel. error {err:.2e}; greedy tokens {'identical' if same else 'DIFFER'}")
    tol = 1e-3 if args.dtype == "float32" else 5e-2
    return 0 if (err < tol and (same or args.dtype != "float32")) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
