// KVOFF_CUDA_CHECK: checks the cudaError_t of a CUDA runtime call and throws
// kvoff::kernels::CudaError, whose message names the call, the error and where it happened.
// Torch-free: used by the kernels in this folder; the torch glue uses C10_CUDA_CHECK instead
// and turns a CudaError into a c10::Error.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace kvoff::kernels {

class CudaError : public std::runtime_error {
 public:
  CudaError(cudaError_t code, const std::string& what) : std::runtime_error(what), code_(code) {}
  cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

[[noreturn]] inline void throw_cuda_error(cudaError_t code, const char* expr, const char* file,
                                          int line) {
  // Clear the thread's last-error state so that a later, unrelated check does not report this
  // (non-sticky) error a second time.
  (void)cudaGetLastError();
  throw CudaError(code, std::string("CUDA error ") + cudaGetErrorName(code) + " (" +
                            cudaGetErrorString(code) + ") from `" + expr + "` at " + file + ":" +
                            std::to_string(line));
}

}  // namespace kvoff::kernels

#define KVOFF_CUDA_CHECK(expr)                                                       \
  do {                                                                               \
    const cudaError_t kvoff_cuda_check_err_ = (expr);                                \
    if (kvoff_cuda_check_err_ != cudaSuccess) {                                      \
      ::kvoff::kernels::throw_cuda_error(kvoff_cuda_check_err_, #expr, __FILE__, __LINE__); \
    }                                                                                \
  } while (0)
