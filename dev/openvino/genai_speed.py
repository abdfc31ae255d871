"""OpenVINO GenAI's speculative decoding against its own plain decoding, for drafts converted two ways.

Run with the python of the environment holding optimum-intel and openvino-genai (docs/layouts.md, "OpenVINO GenAI"):

    ov-env/bin/python dev/openvino/genai_speed.py OV_TARGET PROMPTS_JSONL NAME=OV_DRAFT [NAME=OV_DRAFT ...]

fp32 (``INFERENCE_PRECISION_HINT=f32``), greedy, 128 new tokens, the first 8 prompts of PROMPTS_JSONL (rows with a
``prompt`` field) through the target's chat template, one warm-up call per pipeline. Prints, per draft and k in
(3, 5): the speed-up over plain decoding in the same run, whether every output equals plain decoding's, and the
accepted draft tokens; then plain decoding timed again (its run-to-run ratio, the noise floor). CPU flags first.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai as ov_genai
from transformers import AutoTokenizer

F32 = {"INFERENCE_PRECISION_HINT": "f32"}


def main() -> None:
    """Print the table described in the module docstring."""
    target, prompts_file, drafts = sys.argv[1], sys.argv[2], [a.split("=", 1) for a in sys.argv[3:]]
    flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split()
    print("CPU flags:", " ".join(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")))
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [json.loads(line)["prompt"] for line in open(prompts_file)][:8]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                         return_dict=False) for p in prompts]

    def run(pipe, k: int):
        config = ov_genai.GenerationConfig(max_new_tokens=128)
        if k:
            config.num_assistant_tokens = k
        pipe.generate(ov.Tensor(np.array([ids[0]], dtype=np.int64)), config)
        start, accepted, outputs = time.perf_counter(), 0, []
        for x in ids:
            result = pipe.generate(ov.Tensor(np.array([x], dtype=np.int64)), config)
            outputs.append(list(result.tokens[0]))
            accepted += result.extended_perf_metrics.get_num_accepted_tokens() if k else 0
        return time.perf_counter() - start, accepted, outputs

    plain = ov_genai.LLMPipeline(target, "CPU", **F32)
    plain_time, _, reference = run(plain, 0)
    for name, draft in drafts:
        pipe = ov_genai.LLMPipeline(target, "CPU", draft_model=ov_genai.draft_model(draft, "CPU", **F32), **F32)
        for k in (3, 5):
            seconds, accepted, outputs = run(pipe, k)
            print(f"{name} k={k}: {plain_time / seconds:.2f}x plain, outputs identical {outputs == reference}, "
                  f"accepted {accepted} of {sum(map(len, outputs))} tokens")
        del pipe
    print(f"plain decoding again: {plain_time / run(plain, 0)[0]:.2f}x the first plain run")


if __name__ == "__main__":
    main()
