#!/usr/bin/env bash
# `cmake --install` into a scratch prefix: the layout cmake/Packaging.cmake promises, the paths
# the installed unit names, and that a second install keeps an edited config.
# Usage: install_layout_test.sh BUILD_DIR SOURCE_DIR SCRATCH VERSION
set -euo pipefail
build=$1 src=$2 scratch=$3 version=$4
fail() { echo "FAIL: $*" >&2; exit 1; }

rm -rf "$scratch" && mkdir -p "$scratch"
log=$scratch/install.log
prefix=$scratch/prefix
cmake --install "$build" --prefix "$prefix" >"$log" 2>&1 || { cat "$log"; fail "cmake --install"; }

[[ -x $prefix/bin/zcrelay ]] || fail "no executable bin/zcrelay"
out=$("$prefix/bin/zcrelay" --version)
[[ $out == "zcrelay $version" ]] || fail "bin/zcrelay --version says '$out', want 'zcrelay $version'"

# The default config is the example config, and it loads.
config=$prefix/etc/zcrelay/zcrelay.yaml
cmp -s "$config" "$src/config/zcrelay.example.yaml" || fail "etc/zcrelay/zcrelay.yaml is not config/zcrelay.example.yaml"
"$prefix/bin/zcrelay" --check-config "$config" >/dev/null || fail "--check-config $config"

# Every example config, unchanged.
n=0
for f in "$src"/config/*.yaml; do
  cmp -s "$f" "$prefix/share/zcrelay/examples/${f##*/}" || fail "share/zcrelay/examples/${f##*/} missing or different"
  n=$((n + 1))
done
((n >= 2)) || fail "only $n example configs in config/"
cmp -s "$src/deploy/systemd/zcrelay-sockmap.conf" "$prefix/share/zcrelay/examples/systemd/zcrelay-sockmap.conf" ||
  fail "share/zcrelay/examples/systemd/zcrelay-sockmap.conf missing or different"
cmp -s "$src/deploy/systemd/zcrelay.socket" "$prefix/share/zcrelay/examples/systemd/zcrelay.socket" ||
  fail "share/zcrelay/examples/systemd/zcrelay.socket missing or different"

# The unit, with the binary and config paths of this prefix (everything else as in the source).
unit=$prefix/lib/systemd/system/zcrelay.service
[[ -f $unit ]] || fail "no lib/systemd/system/zcrelay.service"
grep -qx "ExecStart=$prefix/bin/zcrelay -c $config" "$unit" || fail "ExecStart in $unit does not name $prefix/bin/zcrelay -c $config"
sed -e "s#$prefix/bin/zcrelay#/usr/bin/zcrelay#g" -e "s#$prefix/etc/zcrelay/#/etc/zcrelay/#g" "$unit" |
  cmp -s - "$src/deploy/systemd/zcrelay.service" || fail "$unit differs from deploy/systemd/zcrelay.service beyond the paths"
# Every absolute path the unit runs exists once installed (systemd-analyze checks the same).
grep -E '^Exec[A-Za-z]*=' "$unit" | sed -E 's/^[^=]*=[-@:+!]*//; s/ .*//' | while read -r exe; do
  [[ -x $exe ]] || fail "$unit runs $exe, which is not an executable"
done

# A reinstall leaves an edited config alone.
echo "# edited" >>"$config"
cmake --install "$build" --prefix "$prefix" >"$log" 2>&1 || { cat "$log"; fail "second cmake --install"; }
tail -n1 "$config" | grep -qx "# edited" || fail "a reinstall overwrote the edited $config"

echo "install layout OK: $(cd "$prefix" && find . -type f | wc -l) files under $prefix"
