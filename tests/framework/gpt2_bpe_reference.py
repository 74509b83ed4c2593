#!/usr/bin/python3
"""A reference of OpenAI GPT-2's byte-level BPE (encoder.py), for test_tokenizer.cpp.

Written from the algorithm: bytes_to_unicode, get_pairs, bpe with merge ranks and GPT-2's
pre-tokenizing pattern, run with the `regex` module (Debian's python3-regex).

  gpt2_bpe_reference.py learn TEXT_FILE N OUT_FOLDER
      learns up to N merges from TEXT_FILE (plain BPE over its pre-tokenized words in byte-unicode
      form) and writes OUT_FOLDER/encoder.json and OUT_FOLDER/vocab.bpe in GPT-2's formats.
  gpt2_bpe_reference.py encode ENCODER_JSON VOCAB_BPE TEXT_FILE
      prints the ids of TEXT_FILE as a JSON list.

Text files are read as bytes and decoded with errors="surrogateescape": a byte that is not valid
UTF-8 becomes a lone surrogate (neither letter, number nor space) and encodes back to its byte.
"""
import collections
import json
import os
import sys

import regex

PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def bytes_to_unicode():
    """Byte -> the character standing for it: printable Latin-1 itself, the rest from U+0100 on."""
    printable = [b for b in range(256) if ord("!") <= b <= ord("~") or 0xA1 <= b <= 0xAC or 0xAE <= b]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


BYTE_ENCODER = bytes_to_unicode()
# GPT-2's encoder.json lists the printable bytes first, then the shifted ones.
BYTE_ORDER = sorted(range(256), key=lambda b: (ord(BYTE_ENCODER[b]) >= 256, ord(BYTE_ENCODER[b])))


def read_text(path):
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="surrogateescape")


def words_of(text):
    """The pre-tokens of `text`, each as its bytes in byte-unicode characters."""
    for token in PATTERN.findall(text):
        yield "".join(BYTE_ENCODER[b] for b in token.encode("utf-8", errors="surrogateescape"))


def get_pairs(word):
    return {(word[i], word[i + 1]) for i in range(len(word) - 1)}


def merge_word(word, first, second):
    """Every occurrence of (first, second) in `word` merged, left to right."""
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == first and word[i + 1] == second:
            out.append(first + second)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def learn(text_file, n_merges, out_folder):
    counts = collections.Counter(words_of(read_text(text_file)))
    words = {tuple(w): c for w, c in counts.items()}
    merges = []
    for _ in range(n_merges):
        pair_counts = collections.Counter()
        for word, c in words.items():
            for i in range(len(word) - 1):
                pair_counts[(word[i], word[i + 1])] += c
        if not pair_counts:
            break
        # the most frequent pair; among equals, the smallest (deterministic)
        best = min(pair_counts, key=lambda p: (-pair_counts[p], p))
        merges.append(best)
        merged = collections.Counter()
        for word, c in words.items():
            merged[merge_word(word, *best)] += c
        words = merged
    encoder = {BYTE_ENCODER[b]: i for i, b in enumerate(BYTE_ORDER)}
    for first, second in merges:
        encoder.setdefault(first + second, len(encoder))
    encoder["<|endoftext|>"] = len(encoder)
    os.makedirs(out_folder, exist_ok=True)
    with open(os.path.join(out_folder, "encoder.json"), "w", encoding="utf-8") as f:
        json.dump(encoder, f)
    with open(os.path.join(out_folder, "vocab.bpe"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for first, second in merges:
            f.write(first + " " + second + "\n")


class Encoder:
    def __init__(self, encoder_json, vocab_bpe):
        with open(encoder_json, encoding="utf-8") as f:
            self.encoder = json.load(f)
        with open(vocab_bpe, encoding="utf-8") as f:
            lines = f.read().split("\n")[1:-1]  # the version line and the empty last line left out
        merges = [tuple(line.split()) for line in lines]
        self.ranks = dict(zip(merges, range(len(merges))))
        self.cache = {}

    def bpe(self, token):
        if token in self.cache:
            return self.cache[token]
        word = tuple(token)
        pairs = get_pairs(word)
        while pairs:
            bigram = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if bigram not in self.ranks:
                break
            word = merge_word(word, *bigram)
            pairs = get_pairs(word)
        self.cache[token] = word
        return word

    def encode(self, text):
        return [self.encoder[symbol] for word in words_of(text) for symbol in self.bpe(word)]


def main(argv):
    if len(argv) == 5 and argv[1] == "learn":
        learn(argv[2], int(argv[3]), argv[4])
    elif len(argv) == 5 and argv[1] == "encode":
        print(json.dumps(Encoder(argv[2], argv[3]).encode(read_text(argv[4]))))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
