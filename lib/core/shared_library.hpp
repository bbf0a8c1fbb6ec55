// A shared library opened at run time (dlopen) rather than linked, so that the binaries start
// on machines without it: NCCL (comm/nccl_api.cu) and cuDNN (backend/cuda/cudnn_attention.cu).
// A library whose every function was found stays open for the life of the process.
#pragma once
#include <dlfcn.h>

#include <string>
#include <type_traits>

namespace trellis {

class SharedLibrary {
 public:
  /// Opens `file` (a name the loader searches for, or a path); `what` names it in errors ("an
  /// NCCL library"). RTLD_GLOBAL where the library's own plugins need its symbols.
  SharedLibrary(const std::string& file, const char* what, int flags = RTLD_NOW | RTLD_LOCAL)
      : file_(file), what_(what), handle_(dlopen(file.c_str(), flags)) {
    if (!handle_) {
      const char* why = dlerror();
      error_ = "cannot load " + file + " (" + (why ? why : "dlopen failed") + ")";
    }
  }
  /// Sets fn to the function `name`; the first one missing is kept in error().
  template <typename F>
  void get(F& fn, const char* name) {
    fn = handle_ ? reinterpret_cast<F>(dlsym(handle_, name)) : nullptr;
    if (!fn && error_.empty()) error_ = file_ + " has no " + name + " (not " + what_ + "?)";
  }
  /// Why it cannot be used ("" when every function asked for was found); a library that cannot
  /// is closed.
  const std::string& finish() {
    if (!error_.empty() && handle_) dlclose(handle_), handle_ = nullptr;
    return error_;
  }

 private:
  std::string file_, what_, error_;
  void* handle_;
};

}  // namespace trellis
