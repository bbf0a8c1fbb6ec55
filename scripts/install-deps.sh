#!/usr/bin/env bash
# Installs the Debian packages Trellis needs, and only those that are missing. Idempotent.
#
# On a cluster, point the build at your own installations instead (module system):
#   MPI_HOME, HDF5_DIR, KOKKOS_ROOT, BLAS_LIBS, CUDA_HOME, NCCL_HOME
# When any of the first four is set, this script installs nothing. (CUDA and NCCL never come from
# here: the build uses them where it finds them, so CUDA_HOME alone changes nothing.)
set -euo pipefail

for var in MPI_HOME HDF5_DIR KOKKOS_ROOT BLAS_LIBS; do
  if [ -n "${!var:-}" ]; then
    echo "install-deps: $var is set: using your installations, installing nothing"
    exit 0
  fi
done

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "install-deps: not a Debian system; install Open MPI, parallel HDF5, Boost.Program_options," >&2
  echo "  Kokkos, OpenBLAS and GoogleTest yourself and set MPI_HOME, HDF5_DIR, KOKKOS_ROOT, BLAS_LIBS" >&2
  exit 0
fi

packages=(
  g++ make
  openmpi-bin libopenmpi-dev
  libhdf5-openmpi-dev hdf5-tools
  libboost-program-options-dev
  libtrilinos-kokkos-dev
  libopenblas-dev
  libgtest-dev
  python3
  python3-torch python3-h5py python3-numpy  # scripts/torch_reference.py, its test (system python)
  gnuplot-nox  # scripts/plot.sh
  slurm-wlm munge  # tests/cli/test_slurm.sh: a one-node Slurm on localhost, started by the test
  clang libclang-rt-14-dev  # make fuzz (libFuzzer), run by make test
)

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [ "$status" = "install ok installed" ] || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
