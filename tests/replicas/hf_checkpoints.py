"""Small Hugging Face tokenizer directories built in the test (no download): a tokenizer
trained with ``tokenizers`` on a few sentences, its tokenizer_config.json with a chat
template in the style of a model family, and generation_config.json.

The templates are written here, in the manner of each family (not copied): Llama 3's
header tokens, Qwen2's ChatML with a default system prompt, Mistral's ``[INST]`` with
``raise_exception`` on roles that do not alternate, and one that uses ``tojson``,
``namespace`` and loop controls.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefix caching lets a replica reuse the keys and values of a shared prompt.",
    "You are a helpful assistant. Answer briefly and exactly.",
    "Hello, how are you today? I am fine, thank you!",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e na\u00efve fa\u00e7ade",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3067\u3059\u3002 \u4e2d\u6587\u4e5f\u53ef\u4ee5",
    "Emoji \U0001F600 \U0001F680 and math \u2211 \u221e \u2248",
    "user assistant system: what is two plus two? four.",
]

LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['content'] is string %}\n"
    "        {%- set content = message['content'] %}\n"
    "    {%- else %}\n"
    "        {%- set content = message['content'] | map(attribute='text') | join('') %}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {{- content | trim }}\n"
    "    {{- '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

CHATML_TEMPLATE = (
    "{%- if messages[0].role != 'system' %}\n"
    "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' }}\n"
    "    {%- if message.content is string %}\n"
    "        {{- message.content }}\n"
    "    {%- else %}\n"
    "        {%- for part in message.content %}\n"
    "            {%- if part.type == 'text' %}{{ part.text }}{% endif %}\n"
    "        {%- endfor %}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

MISTRAL_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('Conversation roles must alternate user/assistant/user/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {{- '[INST] ' + message['content'] + ' [/INST]' }}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token }}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)

# Every message as JSON (non-ASCII kept), counted with a namespace, skipping empty ones.
JSON_TEMPLATE = (
    "{%- set ns = namespace(count=0) %}\n"
    "{%- for message in messages %}\n"
    "    {%- if not message.content %}{% continue %}{% endif %}\n"
    "    {%- set ns.count = ns.count + 1 %}\n"
    "    {{- '<|im_start|>' + (message | tojson) + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{{- 'messages: ' + ns.count | string }}\n"
    "{%- if add_generation_prompt %}{{ '\\n<|im_start|>' }}{% endif %}\n"
)


def byte_level_bpe(specials: list[str], vocab_size: int = 400) -> Tokenizer:
    """A GPT-2 / Llama 3 / Qwen2 kind of tokenizer: byte-level BPE, special tokens added."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def metaspace_bpe(vocab_size: int = 300) -> Tokenizer:
    """A Llama 2 / Mistral kind: BPE over ``▁``-joined words with byte fallback (<0xNN>)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = None
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([s.replace(" ", "\u2581") for s in CORPUS], trainer)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    data = json.loads(tok.to_str())  # the 256 byte tokens, after the trained vocabulary
    vocab = data["model"]["vocab"]
    first = max(vocab.values()) + 1
    vocab.update({f"<0x{b:02X}>": first + b for b in range(256)})
    return Tokenizer.from_str(json.dumps(data))


def _with_bos(tok: Tokenizer, bos: str) -> Tokenizer:
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def _added(tok: Tokenizer) -> dict:
    return {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                     "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
            for i, t in tok.get_added_tokens_decoder().items()}


def write(directory: Path, tok: Tokenizer, config: dict, generation: dict | None,
          template_file: str | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": _added(tok),
              "clean_up_tokenization_spaces": False, "model_max_length": 4096, **config}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if template_file is not None:
        (directory / "chat_template.jinja").write_text(template_file)
    return directory


def llama3(directory: Path) -> Path:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
    tok = _with_bos(byte_level_bpe(specials), "<|begin_of_text|>")
    ids = [tok.token_to_id(t) for t in specials]
    return write(directory, tok, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                  "chat_template": LLAMA3_TEMPLATE},
                 {"bos_token_id": ids[0], "eos_token_id": [ids[1], ids[4]]})


def chatml(directory: Path, template_file: bool = False) -> Path:
    """Qwen2-like; with ``template_file`` the template is chat_template.jinja (as newer
    transformers save it) and the config's own entry differs, so it must lose."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = byte_level_bpe(specials)
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
              "chat_template": "{{ 'not this one' }}" if template_file else CHATML_TEMPLATE}
    return write(directory, tok, config,
                 {"eos_token_id": [tok.token_to_id("<|im_end|>"),
                                   tok.token_to_id("<|endoftext|>")]},
                 CHATML_TEMPLATE if template_file else None)


def mistral(directory: Path) -> Path:
    tok = _with_bos(metaspace_bpe(), "<s>")
    return write(directory, tok, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                  "chat_template": MISTRAL_TEMPLATE},
                 {"bos_token_id": 1, "eos_token_id": 2})


def json_chat(directory: Path) -> Path:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = byte_level_bpe(specials)
    tok.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    return write(directory, tok, {"eos_token": "<|endoftext|>", "chat_template": JSON_TEMPLATE},
                 {"eos_token_id": tok.token_to_id("<|endoftext|>")})


FAMILIES = {"llama3": llama3, "chatml": chatml, "mistral": mistral, "json": json_chat}
