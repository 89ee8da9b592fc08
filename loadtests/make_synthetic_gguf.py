"""Write a Llama GGUF of the size users run, with random weights, for speed and memory benchmarks.

    python -m loadtests.make_synthetic_gguf --params 1B --type Q4_K_M --out /tmp/llama-1b-q4_k_m.gguf
    python -m loadtests.make_synthetic_gguf --arch gemma3 --params tiny --type Q4_K_M --out /tmp/gemma3-tiny.gguf

The shape is a published Llama-family model's (``SHAPES``: Llama 3.2 1B's layers, with the
embedded model's vocabulary so that its tokenizer metadata, copied from the embedded GGUF, fits;
``--vocab FILE`` takes another GGUF's vocabulary and sizes the embedding for it);
every weight block holds random values with scales chosen so that weights come out about
N(0, 0.02) (random bytes would give random float16 scales, up to 65504). The weights mean
nothing, so acceptance of drafts does too: use the file for plain-decoding speed, pass-cost
curves and memory. llama.cpp loads it as well (same tensor names, types and metadata).

Quantisation mixes follow llama.cpp's for the file types: Q4_K_M keeps attn_v and ffn_down in
Q6_K on the first and last eighth of the layers and on every third layer between, and the
output (here the tied token embedding) in Q6_K; Q5_K_M likewise with Q5_K; the others are one
type throughout.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

SHAPES = {
    # hidden, intermediate, layers, heads, kv heads (Llama 3.2 1B; vocabulary: the embedded model's)
    "1B": (2048, 8192, 16, 32, 8),
    # the embedded model's own shape (SmolLM2-135M), for quick checks
    "135M": (576, 1536, 30, 9, 3),
    # two layers, for tests of the loader (tests/test_gguf_families.py)
    "tiny": (256, 512, 2, 4, 2),
}
# Gemma 3: hidden, intermediate, layers, heads, kv heads, head dim, sliding window. llama.cpp and
# transformers read no layer pattern from a Gemma 3 file (both take every sixth layer as global),
# so "tiny" has six layers: five sliding-window layers of 8 positions, then a global one.
GEMMA3_SHAPES = {
    "270M": (640, 2048, 18, 4, 1, 256, 512),  # gemma-3-270m's shape (with a made-up vocabulary)
    "tiny": (128, 256, 6, 4, 2, 256, 8),
}
ARCHS = ("llama", "qwen2", "gemma3")
# Llama 3.2's rope scaling ("llama3"): factor, low and high frequency factors, original context
LLAMA3_ROPE = (32.0, 1.0, 4.0, 8192)
# file type: (main type, type of the "more bits" tensors and the output)
MIXES = {
    "Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K"), "Q6_K": ("Q6_K", "Q6_K"),
    "Q8_0": ("Q8_0", "Q8_0"), "Q4_0": ("Q4_0", "Q4_0"), "Q4_1": ("Q4_1", "Q4_1"),
    "Q5_0": ("Q5_0", "Q5_0"), "Q5_1": ("Q5_1", "Q5_1"),
}
# What llama.cpp's quantiser uses for a K-quant tensor whose rows are not a multiple of 256
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# llama.cpp's LLAMA_FTYPE numbers, for general.file_type
FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}


def _half(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """uint8 [rows, bytes]: blocks of ``kind`` whose weights are random, about N(0, std) in scale."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    n = rows * cols // weights
    out = rng.integers(0, 256, (n, size), dtype=np.uint8)  # the quantised values: any bits
    if kind in ("Q4_0", "Q5_0", "Q8_0"):  # d, then values centred by the format (q - 8, q - 16, int8)
        spread = {"Q4_0": 4.6, "Q5_0": 9.2, "Q8_0": 74.0}[kind]
        out[:, 0:2] = _half(np.full(n, std / spread))
    elif kind in ("Q4_1", "Q5_1"):  # d, m: weight = d q + m with q uniform on 0..15 / 0..31
        levels = 16 if kind == "Q4_1" else 32
        d = std / (levels / 3.46)
        out[:, 0:2] = _half(np.full(n, d))
        out[:, 2:4] = _half(np.full(n, -d * (levels - 1) / 2))
    elif kind in ("Q4_K", "Q5_K"):  # d, dmin, 12 bytes of 6-bit scales and mins, then values
        levels = 16 if kind == "Q4_K" else 32
        scale = 32  # every sub-block scale 32 and min 32 * (levels - 1) / 2 / 8: centred values
        d = std / (levels / 3.46) / scale
        out[:, 0:2] = _half(np.full(n, d))
        out[:, 2:4] = _half(np.full(n, d * (levels - 1) / 2 * scale / 32))
        # Every sub-block's 6-bit scale and min are 32 (0b100000). Sub-blocks 0-3 keep theirs in
        # the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take their low 4 bits
        # from bytes 8-11 (0 here) and their top 2 from the top bits of bytes 0-3 and 4-7.
        out[:, 4:12] = 32 | (0b10 << 6)
        out[:, 12:16] = 0
    elif kind == "Q6_K":  # 128 + 64 bytes of values, 16 int8 scales, d
        out[:, 192:208] = 32
        out[:, 208:210] = _half(np.full(n, std / 18.5 / 32))
    else:
        raise ValueError(f"no random blocks for {kind}")
    return out.reshape(rows, -1)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth, and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def llama3_rope_factors(head_dim: int, theta: float) -> np.ndarray:
    """One factor per rotary frequency for Llama 3's rope scaling, as llama.cpp's converter writes
    them (``rope_freqs.weight``): 1 for short wavelengths, ``factor`` for long ones, a smooth
    blend between; a frequency is divided by its factor."""
    factor, low, high, original = LLAMA3_ROPE
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gemma_vocabulary(size: int = 512) -> tuple[list[str], list[int]]:
    """A made-up SentencePiece vocabulary laid out as Gemma's (pad, eos, bos, unk, mask, the 256
    byte tokens, then pieces), ``size`` tokens, and the token types (3 control, 2 unknown, 6 byte,
    1 normal). transformers' Gemma tokenizer adds a ``<mask>`` token to a vocabulary without one."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = ["▁"] + letters + ["▁" + c for c in letters]
    pieces += [f"{'▁' if i % 2 else ''}{a}{b}" for i, (a, b) in enumerate((a, b) for a in letters for b in letters)]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += pieces[: size - len(tokens)]
    return tokens, [3, 3, 3, 2, 3] + [6] * 256 + [1] * (len(tokens) - 261)


def write(out: str, params: str, file_type: str, seed: int = 0, arch: str = "llama", rope_freqs: bool = False,
          vocab_file: str | None = None, chat_template: str | None = None, rope_linear: float | None = None) -> None:
    """``arch`` "qwen2": Qwen2's architecture (q, k and v biases, rows in the checkpoint's order);
    "gemma3": Gemma 3's text model (GEMMA3_SHAPES; norms before and after attention and the MLP,
    q and k norms, their weights stored as 1 + w as llama.cpp's converter does, random about 1;
    sliding-window layers; a made-up Gemma-like vocabulary unless ``vocab_file``);
    ``rope_freqs``: Llama 3's rope scaling as llama.cpp writes it (llama only); ``rope_linear``:
    a linear RoPE scaling factor in the metadata, as llama.cpp writes Gemma 3 4B's (8, on its
    global layers; gemma3 only); ``vocab_file``: a
    GGUF whose tokenizer to copy instead of the embedded model's (llama.cpp's
    ``models/ggml-vocab-*.gguf`` carry real families' vocabularies); ``chat_template``: a Jinja
    file to store as the tokenizer's chat template."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    from parrot.engine.source import resolve_source
    from parrot.gguf_file import GGUFFile

    if arch not in ARCHS or (rope_freqs and arch != "llama") or (rope_linear and arch != "gemma3"):
        raise ValueError(f"arch must be one of {ARCHS}, rope_freqs only with llama, rope_linear only with gemma3")
    gemma = arch == "gemma3"
    window = 0
    if gemma:
        hidden, intermediate, layers, heads, kv_heads, head_dim, window = GEMMA3_SHAPES[params]
    else:
        hidden, intermediate, layers, heads, kv_heads = SHAPES[params]
        head_dim = hidden // heads
    main_type, more_type = MIXES[file_type]
    tokenizer = None
    if vocab_file is None and not gemma:
        source = resolve_source("embedded")
        vocab_file = os.path.join(source.path, source.gguf_file or "")
    if vocab_file is not None:
        tokenizer = GGUFFile(vocab_file)
        vocab = len(tokenizer.get("tokenizer.ggml.tokens"))
    else:
        tokens, types = gemma_vocabulary()
        vocab = len(tokens)
    rng = np.random.default_rng(seed)

    theta = 500000.0 if arch == "llama" else 1000000.0
    writer = GGUFWriter(out, arch)
    writer.add_name(f"synthetic-{arch}-{params}-{file_type}")
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if gemma:  # as llama.cpp's converter writes Gemma 3: no rope dimensions, key and value lengths
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(window)
        writer.add_layer_norm_rms_eps(1e-6)
        if rope_linear:
            from gguf import RopeScalingType

            writer.add_rope_scaling_type(RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope_linear)
    else:
        writer.add_rope_dimension_count(head_dim)
        writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(theta)
    writer.add_vocab_size(vocab)
    writer.add_file_type(FILE_TYPES[file_type])
    if tokenizer is not None:
        for key in tokenizer.keys():  # the tokenizer, as it is
            if key.startswith("tokenizer.") and not (chat_template and key == "tokenizer.chat_template"):
                value, vtype, sub = tokenizer.typed(key)
                writer.add_key_value(key, value, GGUFValueType(vtype), None if sub is None else GGUFValueType(sub))
    else:  # the made-up Gemma vocabulary
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_scores([-float(i) for i in range(vocab)])
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(False)
    if chat_template:
        with open(chat_template, encoding="utf-8") as f:
            writer.add_chat_template(f.read())

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        if kind.endswith("_K") and cols % 256:  # rows a K-quant super-block does not divide: llama.cpp's fallback
            kind = K_FALLBACK[kind]
        writer.add_tensor(name, random_blocks(kind, rows, cols, rng), raw_dtype=GGMLQuantizationType[kind])

    def norm(name: str, size: int) -> None:
        # Gemma's norms multiply by 1 + w, which llama.cpp's converter stores: random about 1, so
        # that a reader that gets the convention wrong computes something else
        values = rng.normal(1.0, 0.3, size) if gemma else np.ones(size)
        writer.add_tensor(name, values.astype(np.float32))

    add("token_embd.weight", more_type, vocab, hidden)  # tied: also the output projection
    norm("output_norm.weight", hidden)
    if rope_freqs:
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, theta))
    for i in range(layers):
        v_and_down = more_type if _more_bits(i, layers) else main_type
        add(f"blk.{i}.attn_q.weight", main_type, heads * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", main_type, kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", v_and_down, kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", main_type, hidden, heads * head_dim)
        add(f"blk.{i}.ffn_gate.weight", main_type, intermediate, hidden)
        add(f"blk.{i}.ffn_up.weight", main_type, intermediate, hidden)
        add(f"blk.{i}.ffn_down.weight", v_and_down, hidden, intermediate)
        if arch == "qwen2":  # Qwen2's q, k and v biases, large enough to matter
            for name, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim), ("attn_v", kv_heads * head_dim)):
                writer.add_tensor(f"blk.{i}.{name}.bias", rng.normal(0, 0.5, rows).astype(np.float32))
        norm(f"blk.{i}.attn_norm.weight", hidden)
        norm(f"blk.{i}.ffn_norm.weight", hidden)  # Llama's and Gemma's norm before the MLP
        if gemma:
            norm(f"blk.{i}.post_attention_norm.weight", hidden)
            norm(f"blk.{i}.post_ffw_norm.weight", hidden)
            norm(f"blk.{i}.attn_q_norm.weight", head_dim)
            norm(f"blk.{i}.attn_k_norm.weight", head_dim)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", choices=sorted(set(SHAPES) | set(GEMMA3_SHAPES)), default="1B",
                        help="a shape of SHAPES (llama, qwen2) or GEMMA3_SHAPES (gemma3)")
    parser.add_argument("--type", choices=sorted(MIXES), default="Q4_K_M")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=ARCHS, default="llama",
                        help="qwen2: Qwen2's architecture (QKV biases); gemma3: Gemma 3's text model")
    parser.add_argument("--rope-freqs", action="store_true",
                        help="Llama 3's rope scaling, as rope_freqs.weight (Llama 3.1 and later GGUFs carry it)")
    parser.add_argument("--rope-linear", type=float, metavar="FACTOR",
                        help="gemma3: linear RoPE scaling of the global layers (Gemma 3 4B and larger: 8)")
    parser.add_argument("--vocab", metavar="GGUF",
                        help="copy this GGUF's tokenizer instead of the embedded model's "
                             "(e.g. llama.cpp's models/ggml-vocab-llama-bpe.gguf: Llama 3's)")
    parser.add_argument("--chat-template", metavar="JINJA", help="store this file as the chat template")
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    write(args.out, args.params, args.type, args.seed, args.arch, args.rope_freqs, args.vocab, args.chat_template,
          args.rope_linear)
    print(f"wrote {args.out}: {os.path.getsize(args.out) / 1e6:.0f} MB in {time.perf_counter() - begin:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
