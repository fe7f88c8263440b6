"""A tiny Gemma-4-shaped tokenizer for test and demo checkpoints.

Same pipeline as the real one (and as transformers' `GemmaTokenizer`, which rebuilds exactly this
pipeline from our vocab/merges): BPE with byte fallback, the normalizer turns " " into "▁", no
whitespace pre-split, and the decoder undoes it (Replace ▁, ByteFallback, Fuse). Any text encodes
(unknown characters become `<0xNN>` byte tokens) and decodes back to itself byte for byte. Gemma's
control tokens sit at their real ids; BOS is not added by the tokenizer (the chat template writes
`<bos>`).

Layout of the 512 ids: 0..106 special tokens (real ids, the gaps filled with `<unusedN>`), 107..362
the byte tokens `<0x00>`..`<0xFF>`, then the characters and merges learnt from the built-in corpus.
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

# Gemma 4's special tokens at their ids in the released tokenizer.json. The multimodal markers have
# ids far beyond a tiny vocab (255999, 258880, ...); they get free low ids here so that every token
# the tokenizer_config names exists in the vocab.
SPECIAL_TOKENS: dict[int, str] = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    4: "<mask>",
    46: "<|tool>",
    47: "<tool|>",
    48: "<|tool_call>",
    49: "<tool_call|>",
    50: "<|tool_response>",
    51: "<tool_response|>",
    52: '<|"|>',
    60: "<|image>",
    61: "<image|>",
    62: "<|image|>",
    63: "<|audio>",
    64: "<audio|>",
    65: "<|audio|>",
    66: "<|video|>",
    98: "<|think|>",
    100: "<|channel>",
    101: "<channel|>",
    105: "<|turn>",
    106: "<turn|>",
}
NUM_SPECIAL = 107  # ids 0..106
# For config.json (image_token_id, ...) of the tiny release-format checkpoints.
MULTIMODAL_TOKEN_IDS = {
    "boi_token_id": 60,
    "eoi_token_id": 61,
    "image_token_id": 62,
    "boa_token_id": 63,
    "eoa_token_id": 64,
    "audio_token_id": 65,
    "video_token_id": 66,
}
BYTE_TOKENS = [f"<0x{byte:02X}>" for byte in range(256)]

# A small English corpus, written for this file. It only needs enough variety to fill the vocab
# with plausible merges; everything else falls back to bytes. Its exact text fixes the vocab, which
# the tests' expected token ids depend on.
CORPUS = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox "
    "runs into the woods.\n"
    "A small model can still tell a story. Once upon a time there was a little robot who "
    "wanted to learn to sing.\n"
    "Every morning the robot went to the garden and listened to the birds. The birds sang "
    "about the weather,\n"
    "the trees, the river and the long road to the city. The robot tried to sing with them, "
    "but its voice was\n"
    "thin and strange. It did not give up. It practiced every day, in the rain and in the "
    "wind, until one day\n"
    'a bird stopped and said: "That was a good song." The robot was very happy.\n'
    "What is the capital of France? The capital of France is Paris. What is two plus two? "
    "Two plus two is four.\n"
    "Please write a short poem about the sea. The sea is wide, the sea is deep, it sings the "
    "sailors all to sleep.\n"
    "How are you today? I am fine, thank you. Can you help me with my homework? Of course, I "
    "would be glad to help.\n"
    "The server reads the request, runs the model, and streams the answer back to the client "
    "one token at a time.\n"
    "Speculative decoding lets a small draft model guess the next few tokens, and the large "
    "model checks them all\n"
    "at once. When the guesses are right, the answer arrives faster; when they are wrong, "
    "nothing is lost.\n"
    "Numbers: one, two, three, four, five, six, seven, eight, nine, ten. 0 1 2 3 4 5 6 7 8 9 "
    "10 100 1000.\n"
    "The history of the printing press is a story of people, ideas and machines. Books "
    "became cheaper, and more\n"
    "people learned to read. News traveled faster than ever before, and the world began to "
    "change.\n"
    "She said that the weather would be better in the afternoon, so they waited at the "
    "station and talked about\n"
    "their plans for the summer: a trip to the mountains, a week by the lake, and a long "
    "visit to their family.\n"
    "Water boils at one hundred degrees at sea level. The earth goes around the sun once "
    "every year.\n"
    "In the kitchen, the cook cut the onions, washed the carrots, and put the soup on the "
    "stove to simmer.\n"
)

_TRAIN_SPLIT = pre_tokenizers.Split("▁", behavior="merged_with_next")


def _gemma_pipeline(tokenizer: Tokenizer) -> None:
    """The runtime pipeline of Gemma's tokenizer.json (and of transformers' GemmaTokenizer)."""
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(
        pattern=" ", behavior="merged_with_previous", invert=False
    )
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )


def special_token_list() -> list[str]:
    return [SPECIAL_TOKENS.get(i, f"<unused{i}>") for i in range(NUM_SPECIAL)]


def build_tiny_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Train the tiny BPE on CORPUS to exactly `vocab_size` ids. Deterministic: the corpus is fixed
    and the trainer breaks count ties by the pair itself."""
    specials = special_token_list()
    reserved = specials + BYTE_TOKENS
    if vocab_size <= len(reserved) + 64:
        raise ValueError(
            f"vocab_size {vocab_size} leaves too little room after {len(reserved)} reserved ids"
        )

    # Train with a word-level split (merges never cross a "▁word" boundary, like SentencePiece's
    # pieces), and with the reserved strings as trainer "special tokens" purely so that they take
    # ids 0..362 in order.
    trainer_tokenizer = Tokenizer(BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    trainer_tokenizer.normalizer = normalizers.Replace(" ", "▁")
    trainer_tokenizer.pre_tokenizer = _TRAIN_SPLIT
    trainer = BpeTrainer(
        vocab_size=vocab_size, special_tokens=reserved, show_progress=False, min_frequency=1
    )
    lines = [line + "\n" for line in CORPUS.splitlines()]
    trainer_tokenizer.train_from_iterator(lines, trainer=trainer)

    learnt = json.loads(trainer_tokenizer.to_str())["model"]
    vocab: dict[str, int] = learnt["vocab"]
    merges = [
        tuple(merge) if isinstance(merge, list) else tuple(merge.split(" "))
        for merge in learnt["merges"]
    ]
    if len(vocab) != vocab_size:
        raise RuntimeError(
            f"tiny tokenizer trained to {len(vocab)} ids, wanted {vocab_size}: enlarge CORPUS"
        )
    for token_id, token in enumerate(reserved):
        assert vocab[token] == token_id, (token, vocab[token], token_id)

    # Rebuild as a plain BPE: the byte tokens are ordinary vocab entries (byte fallback looks them
    # up by name), and only the specials are added tokens, matched whole in any input text.
    tokenizer = Tokenizer(
        BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    _gemma_pipeline(tokenizer)
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in specials]
    )
    return tokenizer
