#!/usr/bin/env bash
# Every file includes what it uses: a file that names spdlog::, toml::, nlohmann:: or torch::
# must reach that library's header through its own includes (directly or through the repo's
# headers), not only through the precompiled header every in-tree target shares, which would
# break a build without it (cmake -DCMAKE_DISABLE_PRECOMPILE_HEADERS=ON). A second's check for
# every test run; a build without the PCH is the full one. Also: the plugin SDK (frugal/plugin.h)
# reaches no TOML library, nothing of distributed/ (World) and nothing of app/.
# Usage: bash scripts/check_includes.sh   (from anywhere)
set -euo pipefail
cd "$(dirname "$0")/.."
git ls-files 'framework/*.cpp' 'framework/*.h' 'plugins/*.cpp' 'plugins/*.h' 'tests/*.cpp' \
  'tests/*.h' 'benchmarks/*.cpp' 'examples/*.cpp' 'examples/*.h' 'fuzz/*.cpp' 'fuzz/*.h' |
awk '
function dir(p) { sub(/\/[^\/]*$/, "", p); return p }
function norm(p,   n, parts, out, i, k) {  # a/b/../c -> a/c
  n = split(p, parts, "/"); k = 0
  for (i = 1; i <= n; i++) {
    if (parts[i] == "..") { if (k > 0) k-- } else if (parts[i] != ".") out[++k] = parts[i]
  }
  p = out[1]; for (i = 2; i <= k; i++) p = p "/" out[i]
  return p
}
function resolve(from, inc,   c) {
  c = norm(dir(from) "/" inc); if (c in known) return c
  c = "framework/include/" inc; if (c in known) return c
  c = "framework/src/" inc;     if (c in known) return c
  c = "tests/" inc;             if (c in known) return c
  return ""
}
function reach(f,   i, d, out) {  # the headers f reaches (library and repo), as " a b c "
  if (f in memo) return memo[f]
  memo[f] = " "  # a cycle reads what is known so far
  out = " "
  for (i = 1; i <= ndeps[f]; i++) {
    d = deps[f, i]
    if (d ~ /^lib:/) out = out substr(d, 5) " "
    else out = out "repo:" d " " reach(d)
  }
  memo[f] = out
  return out
}
{ files[++nf] = $0; known[$0] = 1 }
END {
  for (k = 1; k <= nf; k++) {
    f = files[k]; n = 0; text[f] = ""
    while ((getline line < f) > 0) {
      text[f] = text[f] "\n" line
      if (line ~ /^#include[ \t]*[<"]/) {
        inc = line; sub(/^#include[ \t]*[<"]/, "", inc); sub(/[>"].*$/, "", inc)
        r = resolve(f, inc)
        deps[f, ++n] = (r != "") ? r : "lib:" inc
      }
    }
    close(f); ndeps[f] = n
  }
  # What a file names, and the headers (a prefix each) of which it must reach one.
  re[1] = "(^|[^a-z_:])spdlog::(info|warn|error|debug|trace|critical|default_logger|set_default_logger|set_level|flush_on)[(]"
  hd[1] = "spdlog/spdlog.h";  lib[1] = "spdlog (its free functions)"
  re[2] = "(^|[^a-z_:])spdlog::";              hd[2] = "spdlog/";  lib[2] = "spdlog"
  re[3] = "(^|[^a-z_:])toml::";                hd[3] = "toml++/";  lib[3] = "toml++"
  re[4] = "(^|[^a-z_:])nlohmann::";            hd[4] = "nlohmann/"; lib[4] = "nlohmann_json"
  re[5] = "(^|[^a-z_:])(torch|at|c10)::";      hd[5] = "torch/,ATen/,c10/"; lib[5] = "LibTorch"
  bad = 0
  for (k = 1; k <= nf; k++) {
    f = files[k]
    for (j = 1; j <= 5; j++) {
      if (!match(text[f], re[j])) continue
      got = reach(f); nh = split(hd[j], h, ","); ok = 0
      for (q = 1; q <= nh; q++) if (index(got, " " h[q])) ok = 1
      if (!ok) { print "check_includes: " f " uses " lib[j] " but includes no header that brings it (only the PCH does)"; bad = 1 }
    }
  }
  # The plugin SDK: what frugal/plugin.h brings in. No TOML library, no World, no app layer.
  sdk = reach("framework/include/frugal/plugin.h")
  n = split("toml++/ repo:framework/include/frugal/distributed/ repo:framework/include/frugal/app/", banned, " ")
  for (q = 1; q <= n; q++)
    if (index(sdk, " " banned[q])) {
      print "check_includes: frugal/plugin.h (the plugin SDK) reaches " banned[q] ":"
      m = split(sdk, sdkparts, " ")
      for (r = 1; r <= m; r++) if (index(sdkparts[r], "repo:") == 1) printf "  %s\n", sdkparts[r]
      bad = 1
    }
  if (!bad) print "check_includes: every file includes what it uses (spdlog, toml++, nlohmann, LibTorch)"
  exit bad
}'
