// The sections of the run configuration: each option's key, help and limits, and the checks
// across keys. Defaults are the member initializers (config/sections.h).
#include "frugal/config/sections.h"

#include <algorithm>
#include <string>
#include <vector>

#include "config/options_toml.h"
#include "frugal/base/error.h"

namespace frugal {

using detail::contains;
using detail::describe_value;
using detail::dotted;
using detail::quote;

// ---- The built-in options: keys, help, limits. Defaults are the member initializers. ----

void RunOptions::visit(FieldVisitor& v) {
  v.field("seed", seed, "random seed for weights, data order and dropout");
  v.field("device", device,
          outside_training("where to train; auto = cuda when available, else cpu"),
          {"cpu", "cuda", "auto"});
  v.field("out_dir", out_dir,
          outside_training("directory for the report, the resolved config and checkpoints"));
  v.field("threads", threads,
          outside_training("CPU threads: N = N intra-op (ATen) threads and 1 BLAS thread; "
                           "auto = time the first training steps on 1 + 1, all cores + 1 and "
                           "1 + all cores (ATen + BLAS) and keep the fastest; 0 = LibTorch's "
                           "default"),
          at_least_or_auto(0));
  v.field("max_steps", max_steps,
          outside_training("stop the fit after this many batches; 0 = no limit"), at_least(0));
  v.field("log_every", log_every,
          outside_training("batches between log lines when not on a terminal, and between rows "
                           "of the metrics history"),
          at_least(1));
  v.field("progress", progress,
          outside_training("progress display; auto = a bar on a terminal, log lines otherwise"),
          {"auto", "bar", "log", "none"});
  v.field("checkpoint_every", checkpoint_every,
          outside_training("write <out_dir>/checkpoints/last.ckpt every N optimizer steps (and "
                           "at the end of the fit), for `frugal train --resume`; 0 = off"),
          at_least(0));
  v.field("checkpoint_epochs", checkpoint_epochs,
          outside_training("write the checkpoint every N epochs (and at the end of the fit); "
                           "0 = off"),
          at_least(0));
  v.field("keep_checkpoints", keep_checkpoints,
          outside_training("checkpoints kept: 1 = one file, checkpoints/last.ckpt; K > 1 = the "
                           "newest K as checkpoints/step-N.ckpt, last.ckpt linking the newest"),
          at_least(1));
  v.field("resume", resume,
          outside_training("auto = continue the unfinished run of this config in out_dir, start "
                           "fresh when out_dir holds none (as `frugal train --resume auto`)"),
          {"off", "auto"});
  v.field("preempt_signal", preempt_signal,
          outside_training("a signal that, like SIGTERM and SIGINT, makes the run checkpoint and "
                           "exit with code 75 (Slurm: --signal=USR1@120); \"none\" = off"),
          {"SIGUSR1", "SIGUSR2", "SIGHUP", "SIGALRM", "SIGXCPU", "none"});
  v.field("warmup", warmup,
          "training batches at the start of each stage left out of the step-time statistics",
          at_least(0));
  v.field("trace", trace,
          "write a Chrome-trace JSON (Perfetto) of phase spans and live memory to this path; "
          "\"\" = off");
  visit_memory(v);
  visit_history(v);
  visit_safety(v);
}

// The run's safety nets: the best model kept, a diverged step, early stopping.
void RunOptions::visit_safety(FieldVisitor& v) {
  v.field("save_best", save_best,
          "also keep the best model by this validation metric, as best.pt and best.safetensors "
          "in out_dir: valid_loss, accuracy or the task's metric; off = only the final model");
  v.field("on_nonfinite", on_nonfinite,
          "a step whose loss or gradient is inf/NaN: fail = stop the run with an error naming "
          "stage, epoch, batch and parameter; skip = skip the step and count it",
          {"fail", "skip"});
  v.field("early_stopping", early_stopping,
          "stop the fit when this validation metric (valid_loss, accuracy or the task's metric) "
          "has not improved by more than min_delta for patience epochs; off = never");
  v.field("patience", patience, "early stopping: epochs without an improvement", at_least(1));
  v.field("min_delta", min_delta,
          "early stopping: the least change of the metric that counts as an improvement",
          at_least(0));
}

// Memory settings do not change the numbers: micro-batches keep the step's gradients.
void RunOptions::visit_memory(FieldVisitor& v) {
  v.field("memory_budget", memory_budget,
          outside_training("memory the run may hold, e.g. \"1GiB\"; past it an allocation "
                           "fails as out of memory (cpu: the tracking allocator; cuda: the "
                           "allocator's memory fraction); \"\" = none"));
  v.field("on_oom", on_oom,
          outside_training("out of memory in forward or backward: fail, or retry the batch with "
                           "half the micro-batch (same effective batch and gradients)"),
          {"fail", "retry"});
  v.field("oom_retries", oom_retries,
          outside_training("retry: out-of-memory errors allowed on one batch before the run "
                           "stops"),
          at_least(1));
  v.field("micro_batch", micro_batch,
          outside_training("auto = before each stage, find the largest micro-batch that fits "
                           "memory_budget; off = whole batches (or a plugin's split)"),
          {"off", "auto"});
}

// The metrics history's outputs; they do not change what a run computes.
void RunOptions::visit_history(FieldVisitor& v) {
  v.field("metrics", metrics,
          outside_training("write out_dir/metrics.csv and metrics.jsonl: a row every log_every "
                           "batches and per epoch (loss, lr, samples/s, step time, live and peak "
                           "memory, validation)"));
  v.field("tensorboard", tensorboard,
          outside_training("write the same scalars as TensorBoard event files in "
                           "out_dir/tensorboard (tensorboard --logdir runs/)"));
  v.field("plots", plots,
          outside_training("draw loss, learning rate, validation and memory from metrics.csv "
                           "into out_dir/metrics.svg and .png with gnuplot when the fit ends"));
}

void RunOptions::check() const {
  if (save_best.empty() || early_stopping.empty())
    throw_config_error(std::string("'run.") + (save_best.empty() ? "save_best" : "early_stopping") +
                       "' = \"\": name a validation metric (valid_loss, accuracy or the task's) "
                       "or \"off\"");
  if (micro_batch == "auto" && memory_budget.bytes == 0)
    throw_config_error("'run.micro_batch' = \"auto\" needs 'run.memory_budget' (the memory the "
                       "micro-batch must fit), e.g. memory_budget = \"1GiB\"");
}

void DataOptions::visit(FieldVisitor& v) {
  v.field("dataset", dataset,
          "dataset: fashion-mnist, synthetic, text, image_folder, csv or one a plugin registers");
  v.field("path", path,
          "the dataset's files: fashion-mnist's IDX folder, image_folder's training folder (one "
          "sub-folder per class), csv's training file");
  v.field("batch_size", batch_size, "training batch size", at_least(1));
  v.field("valid_batch_size", valid_batch_size, "validation batch size", at_least(1));
  v.field("train_samples", train_samples, "use the first N training samples; 0 = all",
          at_least(0));
  v.field("valid_samples", valid_samples,
          "use the first N validation samples; 0 = all, -1 = no validation", at_least(-1));
  v.field("shuffle", shuffle, "shuffle the training samples every epoch");
  v.field("channels", channels, "synthetic data and image_folder: image channels (image_folder: 1 or 3)",
          at_least(1));
  v.field("image_size", image_size,
          "synthetic data and image_folder: image height and width in pixels (image_folder "
          "resizes to it)",
          at_least(1));
  v.field("classes", classes, "synthetic data: number of classes", at_least(2));
  v.field("samples", samples, "synthetic data: number of training samples", at_least(1));
  v.field("paths", paths,
          "text data: files or folders (their text files, recursively, sorted) read as one byte "
          "corpus");
  v.field("block_size", block_size, "text data: tokens per window", at_least(2));
  v.field("windows_per_epoch", windows_per_epoch,
          "text data: random training windows per epoch; 0 = training tokens / block_size",
          at_least(0));
  v.field("tokenizer", tokenizer,
          "text data: bytes (an id per byte), sentencepiece (trained on the training text, or "
          "data.tokenizer_path) or gpt2 (GPT-2's byte-level BPE from data.tokenizer_path)",
          {"bytes", "sentencepiece", "gpt2"});
  v.field("vocab_size", vocab_size, "text data: the pieces of a sentencepiece tokenizer trained on the corpus",
          at_least(260));
  v.field("tokenizer_model", tokenizer_model, "text data: the algorithm of a sentencepiece tokenizer trained on the corpus",
          {"bpe", "unigram"});
  v.field("tokenizer_path", tokenizer_path,
          "text data: an existing tokenizer: a sentencepiece .model file or a folder holding tokenizer.model; "
          "gpt2: the folder of encoder.json and vocab.bpe; \"\" = sentencepiece trains one");
  v.field("valid_path", valid_path,
          "image_folder: the validation folder; csv: the validation file; text: a held-out "
          "file or folder (\"\" = the corpus' last tenth)");
  v.field("label_column", label_column, "csv: the label column's header name; \"\" = the last column");
  v.field("task", task, "csv: what the label is: class labels or regression targets",
          {"classification", "regression"});
  v.field("flip", flip, "images: mirror training images left-right with probability 1/2 (seeded)");
  v.field("crop_padding", crop_padding,
          "images: pad training images by N pixels and crop back at a random offset (seeded); 0 = off",
          at_least(0));
}

/// A tokenizer key the chosen tokenizer does not read (set away from its default) is an error.
void DataOptions::check_tokenizer_keys() const {
  const bool trains = tokenizer == "sentencepiece" && tokenizer_path.empty();
  const std::string why = tokenizer == "bytes"   ? "data.tokenizer = \"bytes\" has 256 ids"
                          : tokenizer == "gpt2" ? "gpt2's vocabulary is its encoder.json"
                                                : "an existing model (data.tokenizer_path) has its own";
  if (!trains && vocab_size != DataOptions().vocab_size)
    throw_config_error("'data.vocab_size' = " + std::to_string(vocab_size) +
                       " sets a sentencepiece tokenizer trained on the corpus; " + why);
  if (!trains && tokenizer_model != DataOptions().tokenizer_model)
    throw_config_error("'data.tokenizer_model' = \"" + tokenizer_model +
                       "\" sets a sentencepiece tokenizer trained on the corpus; " + why);
  if (tokenizer == "bytes" && !tokenizer_path.empty())
    throw_config_error("'data.tokenizer_path' names an existing tokenizer, but data.tokenizer = \"bytes\": set "
                       "data.tokenizer = \"sentencepiece\" or \"gpt2\"");
}

void DataOptions::check() const {
  if (task == "regression" && dataset != "csv")
    throw_config_error("'data.task' = \"regression\" needs 'data.dataset' = \"csv\" (a float "
                       "label column); dataset \"" + dataset + "\" has class labels");
  if (dataset == "image_folder" && channels != 1 && channels != 3)
    throw_config_error("'data.channels' = " + std::to_string(channels) +
                       ": image_folder reads images as 1 (grey) or 3 (RGB) channels");
  if ((dataset == "image_folder" || dataset == "csv") && valid_path.empty() && valid_samples >= 0)
    throw_config_error("'data.valid_path' is empty: name the " +
                       std::string(dataset == "csv" ? "validation CSV file" : "validation folder") +
                       " of the " + dataset + " dataset, or set 'data.valid_samples' = -1 (no validation)");
  check_tokenizer_keys();
  if (tokenizer == "gpt2" && tokenizer_path.empty())
    throw_config_error("'data.tokenizer' = \"gpt2\" reads GPT-2's encoder.json and vocab.bpe: set "
                       "'data.tokenizer_path' to their folder");
  if ((dataset == "csv" || dataset == "text") && (flip || crop_padding > 0))
    throw_config_error("'data.flip' and 'data.crop_padding' augment images; dataset \"" + dataset +
                       "\" has none");
}

void ModelOptions::visit(FieldVisitor& v) {
  v.field("arch", arch, "architecture: mlp, cnn, resnet, vit or one a plugin registers");
  v.field("width", width,
          "hidden units (mlp), base channels (cnn, resnet), embedding size (vit)", at_least(1));
  v.field("depth", depth, "hidden blocks (mlp), residual blocks (resnet), layers (vit)",
          at_least(1));
  v.field("dropout", dropout, "dropout probability", half_open(0, 1));
  v.field("patch", patch, "vit: patch size in pixels", at_least(1));
  v.field("heads", heads, "vit: attention heads; must divide width", at_least(1));
  v.field("n_layer", n_layer, "gpt: transformer blocks", at_least(1));
  v.field("n_head", n_head, "gpt: attention heads; must divide n_embd", at_least(1));
  v.field("n_embd", n_embd, "gpt: embedding size", at_least(1));
  v.field("block_size", block_size, "gpt: longest context in tokens; 0 = data.block_size",
          at_least(0));
  v.field("init_from", init_from,
          "start from these weights: a model.safetensors (a run's, or any with the model's "
          "tensor names) or a run folder; \"\" = fresh weights from run.seed");
  v.field("init_strict", init_strict,
          "init_from: every tensor loaded must be in the file with its shape, and the file may "
          "hold no other; false = load what matches by name and shape, and log the rest");
  v.field("init_prefixes", init_prefixes,
          "init_from: load only the model's tensors whose names start with one of these "
          "(\"features\", \"stem\"); [] = all");
}

void ModelOptions::check() const {
  if (arch == "vit" && width % heads != 0) {
    const int64_t fixed = (width / heads + 1) * heads;
    throw_config_error("'model.width' (" + std::to_string(width) +
                       ") must be divisible by 'model.heads' (" + std::to_string(heads) +
                       ") for arch \"vit\"; e.g. width = " + std::to_string(fixed));
  }
  if (arch == "gpt" && n_embd % n_head != 0) {
    const int64_t fixed = (n_embd / n_head + 1) * n_head;
    throw_config_error("'model.n_embd' (" + std::to_string(n_embd) +
                       ") must be divisible by 'model.n_head' (" + std::to_string(n_head) +
                       ") for arch \"gpt\"; e.g. n_embd = " + std::to_string(fixed));
  }
}

void LossOptions::visit(FieldVisitor& v) {
  v.field("name", name, "loss: cross_entropy or one a plugin registers");
  v.field("label_smoothing", label_smoothing, "cross_entropy: label smoothing", half_open(0, 1));
}

void StageOptions::visit(FieldVisitor& v) {
  v.field("name", name, "stage name, unique; shown in logs and the report");
  v.field("epochs", epochs, "epochs in this stage", at_least(0));
  v.field("freeze", freeze, "module-name prefixes whose parameters do not train in this stage");
  v.field("image_size", image_size, "resize inputs to this size; 0 = the data's own size",
          at_least(0));
  v.field("seq_len", seq_len,
          "text: train on windows of this many tokens (sequence-length warm-up); 0 = "
          "data.block_size",
          at_least(0));
  v.table("optimizer", optimizer, "this stage's optimizer; keys it omits inherit [optimizer]",
          &has_optimizer);
  v.table("schedule", schedule, "this stage's learning-rate schedule (schedule.h)");
}

void StageOptions::check() const {
  if (schedule.name == "cosine" && schedule.min_lr > optimizer.lr)
    throw_config_error("'schedule.min_lr' (" + std::to_string(schedule.min_lr) +
                       ") must not exceed the stage's optimizer lr (" +
                       std::to_string(optimizer.lr) + ")");
}

void AblationOptions::visit(FieldVisitor& v) {
  v.field("baseline", baseline, "plugins on in every run, the baseline included");
  v.field("techniques", techniques,
          "plugins varied (each alone, all together, all but one); empty = every plugin with a "
          "[plugins.X] table that is not in baseline");
  v.field("repeats", repeats, "runs of each combination; step times are their median",
          at_least(1));
  v.field("steps", steps, "training batches per run", at_least(1));
  v.field("warmup", warmup, "batches left out of the step-time statistics", at_least(0));
  v.field("leave_one_out", leave_one_out, "also run all techniques but one, for each");
}

void AblationOptions::check() const {
  auto dup = [](const std::vector<std::string>& v) -> std::string {
    for (size_t i = 0; i < v.size(); ++i)
      for (size_t j = i + 1; j < v.size(); ++j)
        if (v[i] == v[j]) return v[i];
    return "";
  };
  if (auto d = dup(techniques); !d.empty())
    throw_config_error("'ablation.techniques' names plugin '" + d + "' twice");
  if (auto d = dup(baseline); !d.empty())
    throw_config_error("'ablation.baseline' names plugin '" + d + "' twice");
  for (const auto& t : techniques)
    for (const auto& b : baseline)
      if (t == b)
        throw_config_error("plugin '" + t +
                           "' is in both 'ablation.baseline' and 'ablation.techniques'; a "
                           "baseline plugin is on in every run, so it cannot be varied");
  if (warmup >= steps)
    throw_config_error("'ablation.warmup' (" + std::to_string(warmup) +
                       ") must be less than 'ablation.steps' (" + std::to_string(steps) +
                       "): no step would be timed");
}

void DistributedOptions::visit(FieldVisitor& v) {
  v.field("backend", backend,
          outside_training("collectives: auto = nccl for CUDA devices (when LibTorch has it), "
                           "else gloo"),
          {"auto", "gloo", "nccl"});
  v.field("timeout", timeout,
          outside_training("seconds the rendezvous and each collective may wait for the other "
                           "ranks before the run fails"),
          Limits{1, 86400});
  v.field("bucket_size", bucket_size,
          outside_training("gradient bytes per all-reduce (DDP's bucket_cap_mb)"));
  v.field("overlap", overlap,
          outside_training("launch each gradient bucket's all-reduce as soon as backward has "
                           "completed it, while backward goes on (as DDP); false = all after "
                           "backward (a bucket's copy is then never made beside activations)"));
}

}  // namespace frugal
