#pragma once
// The C interface of libfrugal_sentencepiece.so, the one library that links Debian's
// libsentencepiece. That library carries its own copy of protobuf-lite's symbols, and LibTorch
// loads libprotobuf: in one symbol scope the two copies mix and the process crashes in
// protobuf's static initialisation. So libfrugal never links SentencePiece: it loads this shim
// with RTLD_LOCAL | RTLD_DEEPBIND (data/tokenizer.cpp), which keeps SentencePiece's calls inside
// its own copy. Plain C types only; strings are (pointer, length); buffers the shim returns are
// released with frugal_spm_release.
#include <stddef.h>

extern "C" {

/// What frugal_spm_piece says an id is.
enum FrugalSpmPieceKind { kFrugalSpmNormal = 0, kFrugalSpmByte = 1, kFrugalSpmControl = 2 };

/// Trains a model on `corpus` (fed line by line, without the newlines) with the trainer options
/// keys[i] = values[i]; seeds SentencePiece's generator with `seed`. 0 on success with the
/// serialized model in *model (*model_len bytes); else nonzero and a message in *err.
int frugal_spm_train(const char* const* keys, const char* const* values, int n, const char* corpus,
                     size_t corpus_len, unsigned seed, char** model, size_t* model_len, char** err);
/// A processor for a serialized model; NULL and a message in *err when it is not one.
void* frugal_spm_load(const char* proto, size_t len, char** err);
int frugal_spm_size(const void* processor);
/// The piece of `id` (pointer valid while the processor lives) and its kind.
int frugal_spm_piece(const void* processor, int id, const char** piece, size_t* len);
/// The ids of `text`: 0 on success (*ids, *n; release *ids), else nonzero and *err.
int frugal_spm_encode(const void* processor, const char* text, size_t len, int** ids, size_t* n, char** err);
void frugal_spm_free(void* processor);
void frugal_spm_release(void* buffer);
}
