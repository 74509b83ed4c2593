#pragma once
/// frugal's version, and the plugin ABI version (bumped on any change a plugin would see).
namespace frugal {
inline constexpr const char* kVersion = "0.1.0";
// 2: Callback::save_state, load_state, held_bytes. 3: FieldVisitor takes Help and ByteSize
// fields; Options::unknown_key_note. 4: Callback::relations, release_caches (the vtable
// changed); OomError's phase; MemoryWindow handles. 5: MemoryMeter::empty_cache returns the
// bytes released, allocator_stats(); Limits::or_auto. 6: headers in
// subsystem folders; Callback::retry_veto, optimizer_replaced; Learner::collective,
// completes_step (the Learner's layout changed); OptimizerOptions::own is an OwnKeys.
// 7: Registry::Entry::reads, ModelOptions' init keys. 8: DataOptions' tokenizer keys, Dataset's
// tokenizer and token_bytes, MetricSums::bytes (layouts changed). 9: Callback::attach (the
// vtable changed), Learner::run_info, AdaptableLinear and LinearAdapter, WeightNames.
// 10: DataParallel's layout (overlap, flags), DataLoader's shard fields, Adam8bitOptions::fused,
// NonFiniteCheck and StopCallback's layouts. 11: Learner::set_optimizer_state_offloaded (the
// Learner's layout changed); resident() and register_offloaded_deleter (tensor_bytes counts
// only resident bytes). 12: Learner::set_parameter_shards and FullParameters (the Learner's
// layout changed); resident() is false for storage freed to 0 bytes. 13: FusedAdam, FusedAdamW
// and FusedSGD derive from GradientVerdict too (their layout changed); NonFiniteCheck's layout
// (Scan, the verdict it waits for). 14: ThreadChoice holds the timed steps per candidate and
// ThreadTuner its rounds.
inline constexpr int kAbiVersion = 14;
}  // namespace frugal
