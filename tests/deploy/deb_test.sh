#!/usr/bin/env bash
# The .deb: built by cpack into a scratch dir, checked with dpkg-deb (fields, Depends against what
# the binary links, conffiles, paths), extracted (never installed) and run from the extraction.
# Usage: deb_test.sh BUILD_DIR SOURCE_DIR SCRATCH VERSION
set -euo pipefail
build=$1 src=$2 scratch=$3 version=$4
fail() { echo "FAIL: $*" >&2; exit 1; }

rm -rf "$scratch" && mkdir -p "$scratch"
# cpack runs the preinstall target first (a no-op make when the build is up to date).
cpack --config "$build/CPackConfig.cmake" -G DEB -B "$scratch/out" >"$scratch/cpack.log" 2>&1 ||
  { cat "$scratch/cpack.log"; fail "cpack"; }
arch=$(dpkg --print-architecture)
deb=$scratch/out/zcrelay_${version}_${arch}.deb
[[ -f $deb ]] || { ls -l "$scratch/out"; fail "no $deb"; }

field() { dpkg-deb -f "$deb" "$1"; }
[[ $(field Package) == zcrelay ]] || fail "Package: $(field Package)"
[[ $(field Version) == "$version" ]] || fail "Version: $(field Version), want $version"
[[ $(field Architecture) == "$arch" ]] || fail "Architecture: $(field Architecture)"
[[ $(field Maintainer) =~ ^[^\<]+\ \<[^@\>]+@[^\>]+\>$ ]] || fail "Maintainer: '$(field Maintainer)' is not 'Name <email>'"
[[ -n $(field Description) ]] || fail "no Description"
depends=$(field Depends)
echo "Depends: $depends"
# The package names alone, one a line ("a (>= 1), b | c" -> a, b, c).
depends_names=$(tr ',|' '\n\n' <<<"$depends" | sed -E 's/^ *//; s/[ (].*//' | sed '/^$/d')

root=$scratch/root
dpkg-deb -x "$deb" "$root"
bin=$root/usr/bin/zcrelay
[[ -x $bin ]] || fail "no usr/bin/zcrelay in the package"
out=$("$bin" --version)
[[ $out == "zcrelay $version" ]] || fail "the packaged zcrelay --version says '$out'"
"$bin" --check-config "$root/etc/zcrelay/zcrelay.yaml" || fail "the packaged /etc/zcrelay/zcrelay.yaml does not load"
cmp -s "$root/etc/zcrelay/zcrelay.yaml" "$src/config/zcrelay.example.yaml" || fail "/etc/zcrelay/zcrelay.yaml is not the example config"
cmp -s "$root/usr/lib/systemd/system/zcrelay.service" "$src/deploy/systemd/zcrelay.service" ||
  fail "/usr/lib/systemd/system/zcrelay.service is not deploy/systemd/zcrelay.service as it is"
[[ -f $root/usr/share/zcrelay/examples/zcrelay.example.yaml ]] || fail "no /usr/share/zcrelay/examples"

# Nothing outside /usr and /etc (no /usr/local from the build's default prefix).
bad=$(dpkg-deb -c "$deb" | awk '{print $6}' | grep -Ev '^\./((usr|etc)(/|$)|$)|^\./usr/local' || true)
[[ -z $bad ]] || fail "paths outside /usr and /etc, or under /usr/local: $bad"

# Depends names the package of every library the binary links directly (readelf NEEDED), as
# ldd resolves it on this system: the .deb installs where the binary could run.
while read -r lib; do
  path=$(ldd "$bin" | awk -v l="$lib" '$1 == l {print $3}')
  [[ -n $path ]] || fail "ldd does not resolve $lib"
  real=$(readlink -f "$path")
  pkg=
  # usrmerge: dpkg knows a library under the path its package ships, /lib or /usr/lib.
  for p in "$real" "${real#/usr}" "/usr$real" "$path" "${path#/usr}" "/usr$path"; do
    pkg=$(dpkg -S "$p" 2>/dev/null | head -n1 | cut -d: -f1) && [[ -n $pkg ]] && break
  done
  [[ -n $pkg ]] || fail "no Debian package owns $lib ($real)"
  grep -Fxq "$pkg" <<<"$depends_names" || fail "$lib is $pkg's, which Depends does not name"
  echo "  $lib -> $pkg: in Depends"
done < <(readelf -d "$bin" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')

# Every other program the unit runs comes from a package in Depends (ExecReload's /bin/kill).
unit=$root/usr/lib/systemd/system/zcrelay.service
while read -r exe; do
  [[ $exe == /usr/bin/zcrelay ]] && continue
  pkg=
  for p in "$exe" "${exe#/usr}" "/usr$exe"; do
    pkg=$(dpkg -S "$p" 2>/dev/null | head -n1 | cut -d: -f1) && [[ -n $pkg ]] && break
  done
  [[ -n $pkg ]] || fail "the unit runs $exe, which no Debian package here provides"
  grep -Fxq "$pkg" <<<"$depends_names" || fail "the unit runs $exe from $pkg, which Depends does not name"
  echo "  unit runs $exe -> $pkg: in Depends"
done < <(grep -E '^Exec[A-Za-z]*=' "$unit" | sed -E 's/^[^=]*=[-@:+!]*//; s/ .*//' | sort -u)

# conffiles: the config survives upgrades with local edits; every listed file is in the package.
ctl=$scratch/control
dpkg-deb -e "$deb" "$ctl"
grep -qx /etc/zcrelay/zcrelay.yaml "$ctl/conffiles" || fail "/etc/zcrelay/zcrelay.yaml is not a conffile"
while read -r f; do [[ -f $root$f ]] || fail "conffile $f is not in the package"; done <"$ctl/conffiles"
for s in postinst prerm postrm; do
  [[ -x $ctl/$s ]] || fail "no executable maintainer script $s"
  sh -n "$ctl/$s" || fail "$s: syntax error"
done
echo "deb OK: $deb"
