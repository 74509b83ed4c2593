#pragma once
/// frugal's version, and the plugin ABI version (bumped on any change a plugin would see).
namespace frugal {
inline constexpr const char* kVersion = "0.1.0";
inline constexpr int kAbiVersion = 3;  // 3: FieldVisitor takes Help and ByteSize fields; Options::unknown_key_note
}  // namespace frugal
