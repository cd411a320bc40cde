"""Build the small test models from the demo model, locally, with no download.

- ``toy``: the demo model's tokenizer and chat template on one tiny layer
  with random weights. Engine steps cost almost nothing, so a run on it is
  bound by the Python side of the feed (bench/feed.py measures that).
- ``classifier``: the demo model's weights under a new, random three-class
  head (``LlamaForSequenceClassification``, labels negative/neutral/positive),
  for ``task: classify``.
- ``reward``: the same with a one-output head, for ``task: reward`` and
  ``task: score`` (a reward model and a cross-encoder have the same shape).
- ``vlm``: a tiny vision-language model of SmolVLM's architecture
  (Idefics3: a 2-layer text model of width 128 on the demo tokenizer with
  Idefics3's image tokens added, a 2-layer vision encoder of 64x64 images,
  random weights, a locally built processor and chat template); one image
  is 7 prompt tokens.
- ``lora``: a LoRA adapter of the demo model (rank 8 on the attention
  projections, random weights, made with ``peft``), large enough to change
  what the model generates.
- ``reasoner``: the toy model with ``<think>``/``</think>`` as single,
  non-special tokens whose (tied) embedding rows are zero, and a chat template
  whose generation prompt opens ``<think>`` (``<think></think>`` with
  ``enable_thinking: false``, Qwen3's switch): greedy decoding never picks a
  marker, so every ``</think>`` in its output was forced by
  ``thinking_token_budget`` (docs/dev/vllm-reasoning.md, section 6).

The demo model itself is the embedding model (``task: embed``: vLLM pools its
last token).

Run once by ``make setup``. Usage: python scripts/make_test_models.py DEMO_MODEL_DIR OUT_DIR [NAME ...]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


# The toy model's shape: one decoder layer of width 64, one attention head of 64.
TOY_SHAPE = {
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 64,
}


def copy_tokenizer(demo: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (demo / name).exists():
            shutil.copy(demo / name, out / name)


def make_toy(demo: Path, out: Path) -> None:
    """One decoder layer of width 64 (3.2 M parameters, nearly all the embedding), random weights; one
    attention head of 64 (vLLM's CPU attention has no kernels for heads of 16)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(demo)
    config.update(TOY_SHAPE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    copy_tokenizer(demo, out)


def make_head(demo: Path, out: Path, labels: list[str]) -> None:
    """The demo model's weights under a new classification head with ``labels`` (seeded random)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        demo, num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={v: i for i, v in enumerate(labels)}
    )
    model.save_pretrained(out)
    copy_tokenizer(demo, out)


def make_lora(demo: Path, out: Path) -> None:
    """A random rank-8 LoRA adapter of the demo model (``init_lora_weights=False``: B is not zero, so the
    adapter changes the outputs), saved as PEFT saves adapters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(demo)
    config = LoraConfig(r=8, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)


# -- vlm: a tiny Idefics3 (SmolVLM's architecture) ------------------------------------------------------
# ---------------------------------------------------------------------------
# Tiny geometry.  Vision: 64x64 image, 16x16 patches -> 4x4 = 16 patches;
# pixel-shuffle with scale_factor 2 -> 16 / 4 = 4 <image> tokens per image.
# ---------------------------------------------------------------------------
IMAGE_SIZE = 64
PATCH_SIZE = 16
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # = 4

VISION = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 32 (ViT attention is torch SDPA on CPU)
    num_channels=3,
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
    hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6,
)

# Text tower: the demo Llama config shrunk.  head_dim stays 64 because vLLM's
# CPU attention backend only supports head sizes {32, 64, 80, 96, ...}.
TEXT_OVERRIDES = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
)

FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
ROW_COL_TOKENS = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
EXTRA_TOKENS = [FAKE_IMAGE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE, GLOBAL_IMAGE_TOKEN, *ROW_COL_TOKENS]

# SmolVLM's chat template (HuggingFaceTB/SmolVLM-*-Instruct), extended so that
# plain-string message contents also work.  Image parts become "<image>", which
# the processor (HF or vLLM) expands to
#   <fake_token_around_image><global-img><image>*4<fake_token_around_image>
CHAT_TEMPLATE = (
    "<|im_start|>"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}"
    "{{ ': ' + message['content'] }}"
    "{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}"
    "{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<end_of_utterance>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def make_vlm(demo: Path, out: Path, *, seed: int = 0, dtype: str = "float32") -> None:
    """Write a tiny random Idefics3ForConditionalGeneration + Idefics3Processor to ``out``."""
    import torch
    from transformers import (
        AddedToken,
        AutoTokenizer,
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaConfig,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    demo, out = Path(demo), Path(out)
    out.mkdir(parents=True, exist_ok=True)

    # -- tokenizer: demo tokenizer + the Idefics3 special tokens ---------------
    tok = AutoTokenizer.from_pretrained(str(demo))
    tok.add_tokens(
        [AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False) for t in EXTRA_TOKENS],
        special_tokens=True,
    )
    # SmolVLM ends each turn with <end_of_utterance> and uses it as eos.
    tok.eos_token = END_OF_UTTERANCE
    if tok.pad_token is None:
        tok.pad_token = "<|im_end|>"
    tok.chat_template = CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in EXTRA_TOKENS}
    assert all(i is not None and i != tok.unk_token_id for i in ids.values()), ids
    for t in EXTRA_TOKENS:  # each must be ONE token
        assert tok(t, add_special_tokens=False)["input_ids"] == [ids[t]], t
    vocab_size = len(tok)

    # -- image processor: no splitting; every image -> one 64x64 square --------
    image_processor = Idefics3ImageProcessorPil(
        do_resize=True,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=False,
        do_pad=True,
        do_convert_rgb=True,
        do_rescale=True,
        do_normalize=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )
    assert processor.image_token_id == ids[IMAGE_TOKEN]
    # Idefics3Processor.__init__ resets the extra-special-token list to its 3
    # tokens; list all 40 again (they are special added tokens either way).
    tok.add_special_tokens({"additional_special_tokens": EXTRA_TOKENS})

    # -- model config -----------------------------------------------------------
    demo_cfg = json.loads((demo / "config.json").read_text())
    text_cfg = {
        k: v
        for k, v in demo_cfg.items()
        if k not in ("architectures", "_model_name_or_path", "dtype", "torch_dtype", "transformers_version")
    }
    text_cfg.update(TEXT_OVERRIDES)
    pad_id = tok.pad_token_id
    text_cfg.update(
        model_type="llama",
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=ids[END_OF_UTTERANCE],
        pad_token_id=pad_id,
    )
    text_config = LlamaConfig(**text_cfg)
    config = Idefics3Config(
        text_config=text_config.to_dict(),
        vision_config=dict(VISION),
        image_token_id=ids[IMAGE_TOKEN],
        scale_factor=SCALE_FACTOR,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        bos_token_id=text_config.bos_token_id,
        eos_token_id=ids[END_OF_UTTERANCE],
    )
    config.architectures = ["Idefics3ForConditionalGeneration"]

    # -- random weights -------------------------------------------------------
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=text_config.bos_token_id,
        eos_token_id=[ids[END_OF_UTTERANCE], tok.convert_tokens_to_ids("<|im_end|>")],
        pad_token_id=pad_id,
    )

    model.save_pretrained(str(out))
    processor.save_pretrained(str(out))  # tokenizer + image processor + chat template


THINK_START, THINK_END = "<think>", "</think>"
# The demo template with Qwen3's switch: the generation prompt ends exactly on the start marker, so a
# thinking budget of N gives N trace tokens (vllm/v1/sample/thinking_budget_state.py counts prompt
# tokens after the marker against the budget).
REASONER_TEMPLATE_END = (
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think></think>' }}"
    "{% else %}{{ '<think>' }}{% endif %}{% endif %}"
)


def make_reasoner(demo: Path, out: Path) -> None:
    """The toy model's shape (seed 0) on the demo tokenizer plus the two markers as single, non-special
    tokens (kept in the detokenized text, as real Qwen3/R1 tokenizers keep them), their embedding rows
    zero: their logits are exactly 0, below the random model's greedy pick at every step."""
    import torch
    from transformers import AddedToken, AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK_START, THINK_END)])
    for t in (THINK_START, THINK_END):  # each must be ONE token
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    template = (demo / "chat_template.jinja").read_text()
    head, sep, _ = template.rpartition("{% if add_generation_prompt %}")
    assert sep, "the demo chat template has no generation prompt"
    tok.chat_template = head + REASONER_TEMPLATE_END
    config = AutoConfig.from_pretrained(demo)
    config.update({**TOY_SHAPE, "vocab_size": len(tok)})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for t in (THINK_START, THINK_END):
            model.get_input_embeddings().weight[tok.convert_tokens_to_ids(t)] = 0.0
    model.save_pretrained(out)
    tok.save_pretrained(out)
    if (demo / "generation_config.json").exists():
        shutil.copy(demo / "generation_config.json", out / "generation_config.json")


BUILDERS = {
    "toy": make_toy,
    "classifier": lambda demo, out: make_head(demo, out, ["negative", "neutral", "positive"]),
    "reward": lambda demo, out: make_head(demo, out, ["reward"]),
    "lora": make_lora,
    "vlm": make_vlm,
    "reasoner": make_reasoner,
}


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    demo, out_root = Path(sys.argv[1]), Path(sys.argv[2])
    for name in sys.argv[3:] or list(BUILDERS):
        BUILDERS[name](demo, out_root / name)
        print(f"test model '{name}' written to {out_root / name}")


if __name__ == "__main__":
    main()
