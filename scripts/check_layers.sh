#!/usr/bin/env bash
# Fails when a framework folder includes a folder above it (ARCHITECTURE.md, "Who may include
# whom"). The folders, lowest first: a file may include its own folder and the ones before it.
# Headers are named "frugal/<folder>/x.h" (public) or "<folder>/x.h" (private, framework/src).
# The SDK headers frugal/plugin.h and frugal/plugin_export.h sit at core's level; frugal.h (all
# of it) and cli/ at the top. Usage: bash scripts/check_layers.sh   (from anywhere)
set -euo pipefail
cd "$(dirname "$0")/.."
layers=(base memory config data models optim io core distributed callbacks app)
declare -A rank
for i in "${!layers[@]}"; do rank[${layers[$i]}]=$i; done
top=${#layers[@]}

rank_of_file() {  # the layer of a file under framework/
  local f=$1 rest
  case $f in
    framework/cli/*) echo "$top"; return ;;
    framework/include/frugal/plugin.h|framework/include/frugal/plugin_export.h) echo "${rank[core]}"; return ;;
    framework/include/frugal/frugal.h) echo "$top"; return ;;
    framework/include/frugal/*) rest=${f#framework/include/frugal/} ;;
    framework/src/*) rest=${f#framework/src/} ;;
    *) echo "-"; return ;;
  esac
  local folder=${rest%%/*}
  if [ "$folder" = "$rest" ] || [ -z "${rank[$folder]:-}" ]; then
    echo "?"; return
  fi
  echo "${rank[$folder]}"
}

bad=0
while IFS= read -r f; do
  r=$(rank_of_file "$f")
  if [ "$r" = "?" ]; then
    echo "check_layers: $f is in no known folder (${layers[*]}): put it in one, or add its folder here and to ARCHITECTURE.md"
    bad=1; continue
  fi
  [ "$r" = "-" ] && continue
  while IFS=: read -r line inc; do
    inc=${inc#*\"}; inc=${inc%%\"*}
    path=${inc#frugal/}
    folder=${path%%/*}
    [ "$folder" = "$path" ] && continue            # a top-level or same-folder header
    [ -z "${rank[$folder]:-}" ] && continue        # not a framework folder
    if [ "${rank[$folder]}" -gt "$r" ]; then
      echo "check_layers: $f:$line includes \"$inc\": $folder is above ${layers[$r]}"
      bad=1
    fi
  done < <(grep -n '^#include "' "$f" || true)
done < <(git ls-files 'framework/include/*.h' 'framework/src/*.h' 'framework/src/*.cpp' 'framework/cli/*')
# The SDK (frugal/plugin.h) names nothing of the app layer or of distributed/.
if grep -n '"frugal/\(app\|distributed\)/' framework/include/frugal/plugin.h framework/include/frugal/plugin_export.h; then
  echo "check_layers: the plugin SDK includes the app or distributed layer"; bad=1
fi
[ $bad = 0 ] && echo "check_layers: every include points down (${layers[*]})"
exit $bad
