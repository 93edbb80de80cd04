"""A LoRA of seeded random weights for a full-size Wan transformer, in diffusers/PEFT keys
(`transformer.blocks.N.attn1.to_q.lora_A.weight` [rank, in], `.lora_B.weight` [out, rank], float16), on every
attention projection and feed-forward Linear of every block, as the step-distillation LoRAs people stack on Wan.

    python3 bench/make_lora.py TABLE.json MODEL_KEY OUT.safetensors [RANK]

TABLE.json: tests/fixtures/wan2.1-configs.json (its state_dicts[MODEL_KEY].tensors: name -> shape).
Needs numpy only (the safetensors file is written by hand: a JSON header and the raw tensors)."""
import json
import re
import struct
import sys

import numpy as np

TARGETS = re.compile(r"^blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)\.weight$|^blocks\.\d+\.ffn\.net\.(0\.proj|2)\.weight$")


def main(table_path, key, out, rank="32"):
    rank = int(rank)
    tensors = json.load(open(table_path))["state_dicts"][key]["tensors"]
    rng = np.random.default_rng(1)
    named = {}
    for name in sorted(tensors):
        if not TARGETS.match(name):
            continue
        rows, cols = tensors[name]
        stem = "transformer." + name[: -len(".weight")]
        named[stem + ".lora_A.weight"] = (rng.standard_normal((rank, cols), dtype=np.float32) * 0.01).astype(np.float16)
        named[stem + ".lora_B.weight"] = (rng.standard_normal((rows, rank), dtype=np.float32) * 0.01).astype(np.float16)
    header, offset = {}, 0
    for name, t in named.items():
        header[name] = {"dtype": "F16", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in named.values():
            f.write(t.tobytes())
    print(json.dumps({"file": out, "tensors": len(named), "bytes": offset, "rank": rank}))


if __name__ == "__main__":
    main(*sys.argv[1:])
