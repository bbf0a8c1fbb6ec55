# Trellis build. `make` builds build/trellis; `make run` and `make test` also install missing Debian
# packages first (scripts/install-deps.sh). On a cluster, point the build at your modules with
# MPI_HOME, HDF5_DIR, KOKKOS_ROOT, BLAS_LIBS, CUDA_HOME, NCCL_HOME.

.DEFAULT_GOAL := all
SHELL := /bin/bash
MAKEFLAGS += -j$(shell nproc 2>/dev/null || echo 2) --no-print-directory

BUILD    ?= build
CXX      ?= g++
# Tuned for the machine that builds (CI builds where it runs). Override ARCH_FLAGS to cross-build.
ARCH_FLAGS ?= -march=native
# Line tables (-g1), not full debug information (-g): the file and line of every frame in a stack
# trace (a crash's core file, gdb's backtrace, AddressSanitizer's and UBSan's reports), for about
# three quarters of -g's compile time (2026-12-07: the library's objects -23 to -31 %, a test
# object's -35 %, an emulated GPU's -26 %). At -O3 a debugger's view of local variables is mostly
# "optimized out" anyway: `make OPT_FLAGS='-O0 -g'` (or CHECK_DEBUG=-g for the check builds) for a
# debugger's session.
#
# -fno-trapping-math: no code here reads the FP exception flags, and without it GCC 12 on an
# AVX2-only CPU (AMD EPYC here, x86-64-v3; AVX-512's masks do not need it) vectorises no loop that
# selects between values — fast_expf's clamps — so the GELU, the softmaxes and the cross-entropy
# ran one value at a time (GELU backward 11 ns a value against 0.8 vectorised; make bench's step
# 421-446 ms against 447-521, 2026-12-07). Values are the same bits: each lane does what the scalar
# loop did.
OPT_FLAGS  ?= -O3 -g1 -fno-math-errno -fno-trapping-math
CXXFLAGS   += -std=c++20 $(OPT_FLAGS) $(ARCH_FLAGS) -Wall -Wextra -MMD -MP -Ilib
# What is built only to run checks (the tests, the sanitizer and fuzzing builds, the emulated GPU)
# keeps line tables too.
CHECK_DEBUG := -g1
# The tests' own code (tests/**: checks, and references small enough to be quick anyway) at -O1:
# it compiles in half the time of -O3, and the library it tests keeps OPT_FLAGS. (A build given
# OPT_FLAGS on the command line, as asan-build's, uses it for the tests too.)
TEST_OPT_FLAGS ?= -O1 $(CHECK_DEBUG) -fno-math-errno

# ---- third-party locations (Debian defaults; environment wins) --------------------------------
MPI_HOME    ?= /usr/lib/x86_64-linux-gnu/openmpi
HDF5_DIR    ?= /usr/lib/x86_64-linux-gnu/hdf5/openmpi
KOKKOS_ROOT ?=
BLAS_LIBS   ?= -lopenblas

ifeq ($(KOKKOS_ROOT),)
  KOKKOS_INC  := /usr/include/trilinos
  KOKKOS_LIBS := -ltrilinos_kokkoscore
else
  KOKKOS_INC  := $(KOKKOS_ROOT)/include
  KOKKOS_LIBS := -L$(KOKKOS_ROOT)/lib -Wl,-rpath,$(KOKKOS_ROOT)/lib -lkokkoscore -ldl
endif
ifneq ($(wildcard $(HDF5_DIR)/include/hdf5.h),)
  HDF5_INC := $(HDF5_DIR)/include
else
  HDF5_INC := /usr/include/hdf5/openmpi
endif
BLAS_INC ?= $(firstword $(wildcard /usr/include/x86_64-linux-gnu/openblas-pthread /usr/include/openblas) /usr/include)

# -isystem: third-party headers' warnings are not ours to fix.
# OMPI_SKIP_MPICXX: the deprecated MPI C++ bindings are not used (and would need -lmpi_cxx).
CPPFLAGS += -DOMPI_SKIP_MPICXX=1 -isystem $(MPI_HOME)/include -isystem $(MPI_HOME)/include/openmpi \
            -isystem $(HDF5_INC) -isystem $(KOKKOS_INC) -isystem $(BLAS_INC)
LDLIBS   += -L$(MPI_HOME)/lib -Wl,-rpath,$(MPI_HOME)/lib -lmpi \
            -L$(HDF5_DIR)/lib -Wl,-rpath,$(HDF5_DIR)/lib -lhdf5 \
            -lboost_program_options $(KOKKOS_LIBS) $(BLAS_LIBS) -lpthread

# ---- optional features ------------------------------------------------------------------------
CUDA_HOME ?= /usr/local/cuda
NVCC      := $(shell command -v $(CUDA_HOME)/bin/nvcc 2>/dev/null || command -v nvcc 2>/dev/null)
NCCL_HOME ?= $(CUDA_HOME)
HAVE_CUDA := $(if $(NVCC),1,)
# NCCL: its header is enough to build the link; libnccl.so.2 is opened at run time (lib/comm/nccl_api.cu).
HAVE_NCCL := $(if $(wildcard $(NCCL_HOME)/include/nccl.h),1,)

# Where nvcc exists the CUDA backend (lib/**/*.cu) is always built, so that every build proves it
# compiles; the binaries then need libcudart at run time (under 2 MB resident), but no GPU unless
# a deck asks for system.backend = cuda; libcublasLt (540 MB: 150 MB resident once loaded) is
# opened only then (backend/cuda/cublaslt_api.cu). sm_80 (A100) and sm_90 (H100/H200) code, no PTX JIT at start.
CUDA_ARCH_FLAGS ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
# (The host code's line tables: -g1 to the host compiler; nvcc's -g would give it -g.)
NVCCFLAGS ?= -std=c++20 -O3 $(CUDA_ARCH_FLAGS) -Xcompiler -Wall,-Wextra,-g1 -Ilib
ifneq ($(HAVE_CUDA),)
  CU_SRC   := $(shell find lib -name '*.cu' | sort)
  CPPFLAGS += -DTRELLIS_HAVE_CUDA=1
  LDLIBS   += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart
  # The NCCL device link (lib/comm/nccl_*.cu) where NCCL exists; it includes mpi.h too.
  ifneq ($(HAVE_NCCL),)
    CPPFLAGS  += -DTRELLIS_HAVE_NCCL=1
    NVCCFLAGS += -DOMPI_SKIP_MPICXX=1 -isystem $(MPI_HOME)/include -isystem $(MPI_HOME)/include/openmpi \
                 -isystem $(NCCL_HOME)/include
    LDLIBS    += -Wl,-rpath,$(NCCL_HOME)/lib64 -Wl,-rpath,$(NCCL_HOME)/lib -ldl
  else
    CU_SRC := $(filter-out lib/comm/nccl_%.cu,$(CU_SRC))
  endif
endif

# ---- sources ----------------------------------------------------------------------------------
LIB_SRC  := $(shell find lib -name '*.cpp' | sort)
LIB_OBJ  := $(LIB_SRC:%.cpp=$(BUILD)/obj/%.o)
CU_OBJ   := $(CU_SRC:%.cu=$(BUILD)/obj/%.cu.o)
APP_OBJ  := $(BUILD)/obj/app/trellis.o
# tests/**/test_*.cpp → unit_tests (one rank); tests/**/mpi_test_*.cpp → mpi_tests (run at np 2 and 4).
# Both link tests/main.cpp and tests/mpi_util.cpp.
TEST_MAIN_OBJ := $(BUILD)/obj/tests/main.o $(BUILD)/obj/tests/mpi_util.o
TEST_SRC := $(shell find tests -name 'test_*.cpp' | sort)
TEST_OBJ := $(TEST_SRC:%.cpp=$(BUILD)/obj/%.o) $(TEST_MAIN_OBJ)
MPI_TEST_SRC := $(shell find tests -name 'mpi_test_*.cpp' | sort)
MPI_TEST_OBJ := $(MPI_TEST_SRC:%.cpp=$(BUILD)/obj/%.o) $(TEST_MAIN_OBJ)
LIBTRELLIS := $(BUILD)/libtrellis.a

# The flags the objects were built with: when they change (say `make NVCC=` after a CUDA build,
# or another ARCH_FLAGS), every object is rebuilt rather than linked stale.
FLAGS_STAMP := $(BUILD)/flags.stamp
FLAGS_NOW   := $(CXX) $(CPPFLAGS) $(CXXFLAGS) | $(TEST_OPT_FLAGS) $(CHECK_DEBUG) | $(NVCC) $(NVCCFLAGS) | $(CU_SRC)
$(shell mkdir -p $(BUILD) && { [ "$$(cat $(FLAGS_STAMP) 2>/dev/null)" = '$(FLAGS_NOW)' ] || \
        echo '$(FLAGS_NOW)' > $(FLAGS_STAMP); })

.PHONY: all deps run test tests bench features fuzz fuzz-build asan-build test-asan clean gpu-bundle
all: features $(BUILD)/trellis

features:
	@printf 'trellis build: CPU (Kokkos + BLAS) ✓ | CUDA %s | NCCL %s\n' \
	  "$(if $(HAVE_CUDA),✓,✗)" "$(if $(HAVE_NCCL),✓,✗)"

deps:
	@bash scripts/install-deps.sh

$(BUILD)/obj/%.o: %.cpp Makefile $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CXX) $(CPPFLAGS) $(CXXFLAGS) -c $< -o $@

# The tests' objects: TEST_OPT_FLAGS, "mpi_util.hpp" from tests/, and GoogleTest's header
# precompiled once with the same flags (tests/gtest_pch.hpp, copied beside its .gch, where gcc
# looks for it): 192 s of compiling the tests instead of 266 (2026-12-07).
TEST_PCH := $(BUILD)/obj/tests/gtest_pch.hpp.gch
$(BUILD)/obj/tests/%: OPT_FLAGS = $(TEST_OPT_FLAGS)
$(BUILD)/obj/tests/%: CPPFLAGS += -Itests
$(TEST_PCH): tests/gtest_pch.hpp Makefile $(FLAGS_STAMP)
	@mkdir -p $(@D)
	cp $< $(@:.gch=)
	$(CXX) $(CPPFLAGS) $(CXXFLAGS) -x c++-header $< -o $@
$(BUILD)/obj/tests/%.o: tests/%.cpp $(TEST_PCH) Makefile $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CXX) $(CPPFLAGS) $(CXXFLAGS) -Winvalid-pch -include $(TEST_PCH:.gch=) -c $< -o $@

# CUDA sources; their dependency files sit next to the objects.
$(BUILD)/obj/%.cu.o: %.cu Makefile $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -MF $(@:.o=.d) -c $< -o $@

# The CUDA objects first: nvcc's are the longest (cuda_attention.cu about a minute for its two
# architectures), which starting first keeps off the end of a parallel build.
$(LIBTRELLIS): $(CU_OBJ) $(LIB_OBJ) $(FLAGS_STAMP)
	@rm -f $@
	ar rcs $@ $(filter %.o,$^)

$(BUILD)/trellis: $(APP_OBJ) $(LIBTRELLIS)
	$(CXX) $(CXXFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/unit_tests: $(TEST_OBJ) $(LIBTRELLIS)
	$(CXX) $(CXXFLAGS) $^ -o $@ $(LDLIBS) -lgtest

$(BUILD)/mpi_tests: $(MPI_TEST_OBJ) $(LIBTRELLIS)
	$(CXX) $(CXXFLAGS) $^ -o $@ $(LDLIBS) -lgtest

# Ranks: as root Open MPI needs --allow-run-as-root; more ranks than cores need --oversubscribe.
MPIRUN  ?= mpirun --oversubscribe $(if $(filter 0,$(shell id -u)),--allow-run-as-root,) --bind-to none
NP      ?= 1
DECK    ?= inputs/default.deck

run:
	@$(MAKE) deps
	@$(MAKE) all
	$(MPIRUN) -np $(NP) $(BUILD)/trellis train $(DECK)

tests: $(LIBTRELLIS) $(BUILD)/unit_tests $(BUILD)/mpi_tests $(BUILD)/trellis

# Also the sanitizer tests and the fuzzers (asan-build), TEST_FUZZ_SECONDS each:
# their recorded findings and seeds replayed, then 10 s of exploring (`make fuzz`: 60), for room
# under CI's 25 minutes.
TEST_FUZZ_SECONDS ?= 10
# (One make for all of them, so that the sanitizer build fills the cores the long last links and
# nvcc compiles of the others leave idle.)
test:
	@$(MAKE) deps
	@$(MAKE) features tests asan-build
	@ASAN_BUILD=$(ASAN_BUILD) FUZZ_SECONDS=$(TEST_FUZZ_SECONDS) bash scripts/run-tests.sh $(BUILD)

bench:
	@$(MAKE) deps
	@$(MAKE) all
	@bash scripts/bench.sh $(BUILD)

# The binaries with every library they need but glibc, libstdc++ and cuBLASLt, for a GPU machine
# without MPI, HDF5, Boost or Kokkos (scripts/gpu-check.sh runs there): built apart, in
# GPU_BUNDLE_BUILD, for any x86-64 host of the last decade (AVX2; -march=native would tie them to
# this machine's AVX-512, which the GPU machine's host may lack) → GPU_BUNDLE_BUILD/gpu-bundle.tar.xz.
GPU_BUNDLE_BUILD ?= build-gpu
GPU_BUNDLE_ARCH  ?= -march=x86-64-v3
gpu-bundle:
	@$(MAKE) BUILD=$(GPU_BUNDLE_BUILD) ARCH_FLAGS='$(GPU_BUNDLE_ARCH)' \
	  $(GPU_BUNDLE_BUILD)/trellis $(GPU_BUNDLE_BUILD)/unit_tests
	@bash scripts/gpu-bundle.sh $(GPU_BUNDLE_BUILD)

# ---- the CUDA sources on an emulated GPU (tests/cuda_emu/cuda_emu.hpp) ---------------------------
# Where nvcc exists: lib/**/*.cu rewritten (emulate.sed) and compiled by the host compiler against
# the toolkit's headers, with AddressSanitizer and UBSan, and linked with an emulated runtime and
# cuBLASLt into emu_tests, which runs the GPU tests (test_cuda_*.cpp) with every kernel on the CPU.
ifneq ($(HAVE_CUDA),)
EMU_DIR      := tests/cuda_emu
EMU_CUDNN_SRC := $(EMU_DIR)/emu_cudnn_lib.cpp $(EMU_DIR)/emu_cudnn_run.cpp  # (libcudnn-emu.so's)
EMU_CU_OBJ   := $(CU_SRC:%.cu=$(BUILD)/emu/%.o)
EMU_RT_OBJ   := $(patsubst %.cpp,$(BUILD)/emu/%.o,$(filter-out $(EMU_DIR)/emu_selftest.cpp \
                  $(EMU_DIR)/emu_nccl_lib.cpp $(EMU_CUDNN_SRC),$(wildcard $(EMU_DIR)/*.cpp)))
# The emulated NCCL, a library the emulated NCCL link opens (over MPI between the processes).
EMU_NCCL     := $(abspath $(BUILD))/emu/libnccl-emu.so
EMU_EXPORT   := -Wl,--export-dynamic-symbol=trellis_emu_register_nccl  # for the emulated NCCL
# The emulated cuDNN: its backend API with an interpreter of the graphs (cudnn_graph.cuh opens
# it in place of libcudnn_graph.so.9), where cuDNN's headers are.
EMU_CUDNN    := $(abspath $(BUILD))/emu/libcudnn-emu.so
HAVE_CUDNN   := $(if $(wildcard $(CUDA_HOME)/include/cudnn_graph.h),1,)
EMU_TEST_OBJ := $(patsubst %.cpp,$(BUILD)/obj/%.o,$(wildcard tests/*/test_cuda_*.cpp \
                  tests/comm/test_nccl_link.cpp)) $(TEST_MAIN_OBJ)
EMU_FLAGS    := -std=c++20 -O2 $(CHECK_DEBUG) -fno-omit-frame-pointer -fsanitize=address,undefined \
                -fno-sanitize-recover=all -Wall -Wextra -Wno-unknown-pragmas -Ilib -I$(EMU_DIR) \
                $(CPPFLAGS) -isystem $(CUDA_HOME)/include -isystem $(NCCL_HOME)/include \
                -DTRELLIS_EMU_NCCL_LIBRARY='"$(EMU_NCCL)"' -DTRELLIS_EMU_CUDNN_LIBRARY='"$(EMU_CUDNN)"'
$(BUILD)/emu/%.cpp: %.cu $(EMU_DIR)/emulate.sed
	@mkdir -p $(@D)
	sed -f $(EMU_DIR)/emulate.sed $< > $@
$(BUILD)/emu/lib/%.o: $(BUILD)/emu/lib/%.cpp $(EMU_DIR)/cuda_emu.hpp Makefile $(FLAGS_STAMP)
	$(CXX) $(EMU_FLAGS) -include cuda_emu.hpp -MMD -MP -c $< -o $@
$(BUILD)/emu/$(EMU_DIR)/%.o: $(EMU_DIR)/%.cpp Makefile $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CXX) $(EMU_FLAGS) -MMD -MP -c $< -o $@
# The emulator's fibers, barriers and shuffles (emu_device.cpp), under every kernel's every
# step, without the sanitizers (a quarter of the emulated training tests' time): the kernels
# calling it keep theirs. It unpoisons the fiber stacks it reuses (TRELLIS_EMU_FOR_ASAN).
EMU_RUNTIME_FLAGS := $(filter-out -fsanitize=% -fno-sanitize-recover=%,$(EMU_FLAGS)) \
                     -DTRELLIS_EMU_FOR_ASAN
$(BUILD)/emu/$(EMU_DIR)/emu_device.o: $(EMU_DIR)/emu_device.cpp $(EMU_DIR)/cuda_emu.hpp Makefile $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CXX) $(EMU_RUNTIME_FLAGS) -MMD -MP -c $< -o $@
$(EMU_NCCL): $(EMU_DIR)/emu_nccl_lib.cpp Makefile
	@mkdir -p $(@D)
	$(CXX) -std=c++20 -O2 $(CHECK_DEBUG) -fPIC -shared -Wall -Wextra $(CPPFLAGS) -isystem $(CUDA_HOME)/include \
	  -isystem $(NCCL_HOME)/include $< -o $@ -L$(MPI_HOME)/lib -lmpi
ifneq ($(HAVE_NCCL),)
$(BUILD)/emu_tests $(BUILD)/trellis-emu: | $(EMU_NCCL)
endif
$(EMU_CUDNN): $(EMU_CUDNN_SRC) $(EMU_DIR)/emu_cudnn.hpp Makefile
	@mkdir -p $(@D)
	$(CXX) -std=c++20 -O2 $(CHECK_DEBUG) -fPIC -shared -Wall -Wextra -isystem $(CUDA_HOME)/include \
	  $(EMU_CUDNN_SRC) -o $@
ifneq ($(HAVE_CUDNN),)
$(BUILD)/emu_tests $(BUILD)/trellis-emu: | $(EMU_CUDNN)
endif
$(BUILD)/emu_tests: $(EMU_TEST_OBJ) $(BUILD)/emu/$(EMU_DIR)/emu_selftest.o $(EMU_CU_OBJ) $(EMU_RT_OBJ) $(LIB_OBJ)
	$(CXX) $(CXXFLAGS) -fsanitize=address,undefined $^ -o $@ $(EMU_EXPORT) \
	  $(filter-out -lcudart,$(LDLIBS)) -lgtest
# The application on the emulated GPU: system.backend = cuda runs there (tests/cli/test_emulated_gpu.sh).
$(BUILD)/trellis-emu: $(APP_OBJ) $(EMU_CU_OBJ) $(EMU_RT_OBJ) $(LIB_OBJ)
	$(CXX) $(CXXFLAGS) -fsanitize=address,undefined $^ -o $@ $(EMU_EXPORT) \
	  $(filter-out -lcudart,$(LDLIBS))
.PRECIOUS: $(BUILD)/emu/%.cpp
tests: $(BUILD)/emu_tests $(BUILD)/trellis-emu
-include $(EMU_CU_OBJ:.o=.d) $(EMU_RT_OBJ:.o=.d) $(BUILD)/emu/$(EMU_DIR)/emu_selftest.d
endif

# ---- the sanitizer build: AddressSanitizer + UBSan tests, and the fuzzers -----------------------
# The readers of untrusted input (the checkpoint reader, the deck parser: lib/ckpt, lib/config and
# lib/core, the code they run) and their tests, built once with the sanitizers into their own
# directory by this same Makefile, and linked twice:
# - asan_tests, the checkpoint and deck tests: any report ends the program with a failure;
# - the fuzzers (libFuzzer), each run FUZZ_SECONDS by scripts/fuzz.sh: new inputs go to
#   ASAN_BUILD/fuzz/corpus-*, seeds are in tests/fuzz/corpus, earlier findings (replayed first) in
#   tests/fuzz/findings.
# Compiled by clang (libFuzzer's; Debian's is installed by `make deps`), whose objects carry the
# coverage libFuzzer steers by (-fsanitize=fuzzer-no-link) and cost the asan tests nothing they
# would notice; a UBSan report ends a fuzzer as it ends the tests (-fno-sanitize-recover). One
# build where there were two, g++'s for the tests and clang's for each fuzzer, each of them
# compiling lib/core again: about 200 s less CPU in `make test` (2026-12-07). Without clang and its
# sanitizer runtimes (libclang-rt-*-dev) the asan tests are built by CXX and the fuzzers skipped.
# Leak checking is off: Open MPI and HDF5 keep allocations for the life of the process by design,
# which LeakSanitizer would report at every exit.
ASAN_BUILD   ?= build-asan
CLANGXX      ?= clang++
HAVE_CLANG   := $(if $(shell command -v $(CLANGXX) 2>/dev/null),$(if $(wildcard \
                  $(shell $(CLANGXX) -print-runtime-dir 2>/dev/null)/libclang_rt.fuzzer*.a),1,),)
ASAN_CXX     := $(if $(HAVE_CLANG),$(CLANGXX),$(CXX))
ASAN_OPT_FLAGS := -O1 $(CHECK_DEBUG) -fno-omit-frame-pointer -fsanitize=address,undefined \
                  -fno-sanitize-recover=all $(if $(HAVE_CLANG),-fsanitize=fuzzer-no-link)
FUZZ_SECONDS ?= 60
# The checkpoint reader and writer, without what turns a checkpoint into a model (export, the
# stored deck as a Config: they need lib/model and lib/config).
CKPT_IO_SRC  := $(filter-out lib/ckpt/export_hf.cpp lib/ckpt/stored_config.cpp,$(wildcard lib/ckpt/*.cpp))
ASAN_SRC := $(sort $(CKPT_IO_SRC) $(wildcard lib/config/*.cpp lib/core/*.cpp)) tests/main.cpp \
            tests/mpi_util.cpp tests/ckpt/test_ckpt_dir.cpp tests/ckpt/mpi_test_ckpt.cpp \
            tests/ckpt/mpi_test_digest.cpp tests/ckpt/mpi_test_read_share.cpp \
            tests/ckpt/test_ckpt_room.cpp \
            tests/config/test_config.cpp tests/config/test_bad_decks.cpp
FUZZ_DECK_SRC := tests/fuzz/fuzz_deck.cpp $(wildcard lib/config/*.cpp lib/core/*.cpp)
FUZZ_CKPT_SRC := tests/fuzz/fuzz_ckpt.cpp $(CKPT_IO_SRC) $(wildcard lib/core/*.cpp)
FUZZERS := $(if $(HAVE_CLANG),$(ASAN_BUILD)/fuzz/fuzz_deck $(ASAN_BUILD)/fuzz/fuzz_ckpt)

$(BUILD)/asan_tests: $(ASAN_SRC:%.cpp=$(BUILD)/obj/%.o)
	$(CXX) $(CXXFLAGS) $^ -o $@ $(LDLIBS) -lgtest
# The fuzzers' entry points, without GoogleTest's header.
$(BUILD)/obj/tests/fuzz/%.o: tests/fuzz/%.cpp Makefile $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CXX) $(CPPFLAGS) $(CXXFLAGS) -c $< -o $@
$(BUILD)/fuzz/fuzz_deck: $(FUZZ_DECK_SRC:%.cpp=$(BUILD)/obj/%.o)
	@mkdir -p $(@D)
	$(CXX) $(CXXFLAGS) -fsanitize=fuzzer $^ -o $@ -lboost_program_options
$(BUILD)/fuzz/fuzz_ckpt: $(FUZZ_CKPT_SRC:%.cpp=$(BUILD)/obj/%.o)
	@mkdir -p $(@D)
	$(CXX) $(CXXFLAGS) -fsanitize=fuzzer $^ -o $@ \
	  -L$(HDF5_DIR)/lib -Wl,-rpath,$(HDF5_DIR)/lib -lhdf5 -L$(MPI_HOME)/lib -Wl,-rpath,$(MPI_HOME)/lib -lmpi
-include $(BUILD)/obj/tests/fuzz/fuzz_deck.d $(BUILD)/obj/tests/fuzz/fuzz_ckpt.d

# asan_tests and the fuzzers in one make of ASAN_BUILD: two at once would write the same objects.
# (Without clang, fuzzers an earlier build left would be stale: removed, not run.)
asan-build:
	@$(MAKE) BUILD=$(ASAN_BUILD) CXX="$(ASAN_CXX)" OPT_FLAGS="$(ASAN_OPT_FLAGS)" \
	  $(ASAN_BUILD)/asan_tests $(FUZZERS)
	@$(if $(HAVE_CLANG),true,rm -f $(ASAN_BUILD)/fuzz/fuzz_deck $(ASAN_BUILD)/fuzz/fuzz_ckpt)
fuzz-build: asan-build

test-asan:
	@$(MAKE) asan-build
	@bash scripts/run-tests.sh --asan-only $(ASAN_BUILD)

fuzz:
	@$(MAKE) deps
	@$(MAKE) fuzz-build
	@bash scripts/fuzz.sh $(ASAN_BUILD) $(FUZZ_SECONDS)

clean:
	rm -rf $(BUILD)

-include $(LIB_OBJ:.o=.d) $(CU_OBJ:.o=.d) $(APP_OBJ:.o=.d) $(TEST_OBJ:.o=.d) $(MPI_TEST_OBJ:.o=.d)
