#!/usr/bin/env bash
# scripts/gpu-bundle.sh BUILD — makes BUILD/gpu-bundle: the binaries (trellis, unit_tests), every
# shared library they need that a bare CUDA machine may lack (Open MPI with its plugins and help
# files, PMIx, HDF5, Boost, Kokkos, OpenBLAS and their dependencies), Open MPI's launcher (as
# build/mpirun, for several ranks on one node), the decks and scripts/gpu-check.sh (with
# gpu-check-summary.sh and torch_bench.py) — so that the GPU checks run on a machine without MPI,
# HDF5, Boost or Kokkos installed. Not carried: the C and C++ runtimes (glibc, libstdc++: the target's own are
# newer), the GPU driver, and cuBLASLt (540 MB: the target's CUDA toolkit or its pip
# nvidia-cublas package provides it; gpu-check.sh looks for it). Also packed as
# BUILD/gpu-bundle.tar.xz, which must stay under 64 MiB. `make gpu-bundle` runs this.
set -euo pipefail
BUILD=${1:-build}
OUT=$BUILD/gpu-bundle
LIMIT_MIB=${BUNDLE_LIMIT_MIB:-64}
for bin in trellis unit_tests; do
  [[ -x $BUILD/$bin ]] || { echo "gpu-bundle: $BUILD/$bin is missing (make $BUILD/$bin)" >&2; exit 1; }
done
rm -rf "$OUT"
mkdir -p "$OUT/build" "$OUT/lib" "$OUT/scripts" "$OUT/inputs" "$OUT/openmpi" "$OUT/pmix"
cp "$BUILD/trellis" "$BUILD/unit_tests" "$OUT/build/"
# The launcher: ranks on this one node only (gpu-check.sh starts it with the `isolated` process
# launcher, which needs no ssh).
launcher=$(readlink -f "$(command -v mpirun)")
cp "$launcher" "$OUT/build/mpirun"
strip --strip-debug "$OUT/build/trellis" "$OUT/build/unit_tests"  # (smaller to carry: a GPU
# run's stack traces name functions, not files and lines; the build directory's binaries keep them)
cp scripts/gpu-check.sh scripts/gpu-check-summary.sh scripts/torch_bench.py "$OUT/scripts/"
cp inputs/*.deck "$OUT/inputs/"

# Open MPI's run-time pieces: the MCA components (dlopen'ed), help texts, default parameters;
# PMIx's components. gpu-check.sh points Open MPI at them (OPAL_PKGLIBDIR and friends).
MPI_HOME=${MPI_HOME:-/usr/lib/x86_64-linux-gnu/openmpi}
pkglibdir=$(ompi_info --path pkglibdir --parsable 2>/dev/null | sed -n 's/^path:pkglibdir://p')
pkgdatadir=$(ompi_info --path pkgdatadir --parsable 2>/dev/null | sed -n 's/^path:pkgdatadir://p')
sysconfdir=$(ompi_info --path sysconfdir --parsable 2>/dev/null | sed -n 's/^path:sysconfdir://p')
[[ -d ${pkglibdir:-} ]] && cp -r "$pkglibdir" "$OUT/openmpi/lib"
# One GPU per process needs no InfiniBand/Omni-Path/libfabric/UCX transport, nor OpenSHMEM: leave
# those components (and the libraries they pull in) behind.
find "$OUT/openmpi/lib" -regextype egrep -regex \
  '.*/mca_[a-z]+_(ucx|ofi|psm|psm2|openib|usnic|uct|portals4|verbs|cm|hcoll|fca|ucc)[a-z_]*\.(so|la)' -delete
find "$OUT/openmpi/lib" -regextype egrep -regex '.*/mca_(spml|sshmem|scoll|memheap|atomic)_.*' -delete
[[ -d ${pkgdatadir:-} ]] && cp -r "$pkgdatadir" "$OUT/openmpi/share"
[[ -d ${sysconfdir:-} ]] && cp -r "$sysconfdir" "$OUT/openmpi/etc"
for d in /usr/lib/x86_64-linux-gnu/pmix2/lib/pmix /usr/lib/x86_64-linux-gnu/pmix/lib/pmix; do
  [[ -d $d ]] && { cp -r "$d" "$OUT/pmix/lib"; break; }
done
for d in /usr/share/pmix /usr/lib/x86_64-linux-gnu/pmix2/share/pmix; do
  [[ -d $d ]] && { cp -r "$d" "$OUT/pmix/share"; break; }
done

# Every library the binaries and those components load, minus the system's own runtimes and the
# CUDA toolkit's big libraries. libcudart (under 1 MB) travels.
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libresolv\.|libutil\.|libstdc\+\+|libgcc_s|libcuda\.|libcublas|libnccl|libnvidia)'
objects=("$OUT/build/trellis" "$OUT/build/unit_tests" "$OUT/build/mpirun")
while IFS= read -r -d '' so; do objects+=("$so"); done < <(find "$OUT/openmpi" "$OUT/pmix" -name '*.so' -print0)
ldd "${objects[@]}" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r name path; do
    [[ $name =~ $skip ]] && continue
    [[ -e $OUT/lib/$name ]] || cp -L "$path" "$OUT/lib/$name"
  done

# What travels is one compressed archive (OpenBLAS alone is 36 MB unpacked).
tar -C "$(dirname "$OUT")" -cJf "$OUT.tar.xz" "$(basename "$OUT")"
size_kib=$(du -sk "$OUT" | cut -f1)
packed_kib=$(( $(stat -c %s "$OUT.tar.xz") / 1024 ))
echo "gpu-bundle: $OUT ($((size_kib / 1024)) MiB, $(ls "$OUT/lib" | wc -l) libraries), packed as" \
     "$OUT.tar.xz ($((packed_kib / 1024)) MiB)"
echo "  on the GPU machine: tar -xJf gpu-bundle.tar.xz && bash gpu-bundle/scripts/gpu-check.sh gpu-bundle/build"
echo "  (README, \"GPUs\": the command for one call of a lease)"
if (( packed_kib > LIMIT_MIB * 1024 )); then
  echo "gpu-bundle: the archive is larger than $LIMIT_MIB MiB" >&2
  exit 1
fi
