#pragma once
/// frugal's version, and the plugin ABI version (bumped on any change a plugin would see).
namespace frugal {
inline constexpr const char* kVersion = "0.1.0";
inline constexpr int kAbiVersion = 2;  // 2: Callback::save_state, load_state, held_bytes
}  // namespace frugal
