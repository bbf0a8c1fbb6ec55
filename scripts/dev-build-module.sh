#!/usr/bin/env bash
# Developer helper: builds one module's tests alone into build/dev/MODULE_tests, without the rest
# of the tree (useful while other modules are mid-edit). Usage: scripts/dev-build-module.sh MODULE
set -euo pipefail
cd "$(dirname "$0")/.."
m=$1
mkdir -p build/dev
inc="-isystem /usr/lib/x86_64-linux-gnu/openmpi/include -isystem /usr/lib/x86_64-linux-gnu/openmpi/include/openmpi -isystem /usr/include/hdf5/openmpi -isystem /usr/include/trilinos -isystem /usr/include/x86_64-linux-gnu/openblas-pthread"
libs="-L/usr/lib/x86_64-linux-gnu/openmpi/lib -lmpi -L/usr/lib/x86_64-linux-gnu/hdf5/openmpi/lib -lhdf5 -lboost_program_options -ltrilinos_kokkoscore -lopenblas -lpthread -lgtest"
srcs=$(ls lib/core/*.cpp lib/$m/*.cpp $(find lib/$m -mindepth 2 -name '*.cpp') tests/$m/*.cpp tests/main.cpp ${EXTRA_SRCS:-} 2>/dev/null | sort -u)
g++ -DOMPI_SKIP_MPICXX=1 -std=c++20 -O2 -g -march=native -fno-math-errno -Wall -Wextra -Ilib $inc $srcs -o build/dev/${m}_tests $libs
echo "built build/dev/${m}_tests"
