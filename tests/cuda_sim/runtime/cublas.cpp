// cuBLAS's handle calls and GEMM (cublasGemmEx, cublasSgemm, cublasDgemm) on the simulated
// streams: a GEMM is a task on the handle's stream, computed in column-major order with fp32 (or
// fp64) accumulation, alpha and beta as cuBLAS documents (beta == 0: C is not read).
#include <cublas_v2.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "internal.hpp"

using namespace cuda_sim;

struct cublasContext {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasPointerMode_t pointer_mode = CUBLAS_POINTER_MODE_HOST;
  cublasMath_t math_mode = CUBLAS_DEFAULT_MATH;
};

namespace {

struct Handles {
  std::mutex mutex;
  std::unordered_set<const cublasContext*> live;
};

Handles& handles() {
  static Handles* const instance = new Handles();  // never destroyed, as the runtime
  return *instance;
}

bool live(cublasHandle_t handle) {
  Handles& all = handles();
  const std::lock_guard lock(all.mutex);
  return handle != nullptr && all.live.count(handle) != 0;
}

float half_to_float(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1Fu;
  const std::uint32_t mantissa = bits & 0x3FFu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign != 0 ? -magnitude : magnitude;
  }
  std::uint32_t result = 0;
  if (exponent == 0x1F) {
    result = sign | 0x7F800000u | (mantissa << 13);  // infinity or NaN
  } else {
    result = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float value = 0;
  std::memcpy(&value, &result, sizeof value);
  return value;
}

std::uint16_t float_to_half(float value) {  // round to nearest even
  std::uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude >= 0x7F800000u) {  // infinity or NaN
    return static_cast<std::uint16_t>(sign | 0x7C00u | (magnitude > 0x7F800000u ? 0x200u : 0u));
  }
  if (magnitude >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // overflow
  if (magnitude < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    const float scaled = std::fabs(value) * 16777216.0f;  // in units of 2^-24
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(std::nearbyint(scaled)));
  }
  const std::uint32_t rounded = magnitude + 0xFFFu + ((magnitude >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

float bfloat16_to_float(std::uint16_t bits) {
  const std::uint32_t widened = static_cast<std::uint32_t>(bits) << 16;
  float value = 0;
  std::memcpy(&value, &widened, sizeof value);
  return value;
}

std::uint16_t float_to_bfloat16(float value) {  // round to nearest even, NaN kept
  std::uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(bits >> 16);
}

double load(const void* data, cudaDataType type, std::size_t index) {
  switch (type) {
    case CUDA_R_32F:
      return static_cast<const float*>(data)[index];
    case CUDA_R_64F:
      return static_cast<const double*>(data)[index];
    case CUDA_R_16F:
      return half_to_float(static_cast<const std::uint16_t*>(data)[index]);
    case CUDA_R_16BF:
      return bfloat16_to_float(static_cast<const std::uint16_t*>(data)[index]);
    default:
      return 0;
  }
}

void store(void* data, cudaDataType type, std::size_t index, double value) {
  switch (type) {
    case CUDA_R_32F:
      static_cast<float*>(data)[index] = static_cast<float>(value);
      break;
    case CUDA_R_64F:
      static_cast<double*>(data)[index] = value;
      break;
    case CUDA_R_16F:
      static_cast<std::uint16_t*>(data)[index] = float_to_half(static_cast<float>(value));
      break;
    case CUDA_R_16BF:
      static_cast<std::uint16_t*>(data)[index] = float_to_bfloat16(static_cast<float>(value));
      break;
    default:
      break;
  }
}

/// One GEMM: C = alpha op(A) op(B) + beta C, column-major.
struct Gemm {
  cublasOperation_t transa, transb;
  int m, n, k;
  const void* a;
  cudaDataType a_type;
  int lda;
  const void* b;
  cudaDataType b_type;
  int ldb;
  void* c;
  cudaDataType c_type;
  int ldc;
  bool double_accumulation;
  double alpha, beta;

  /// op(A) as an m x k column-major matrix (and op(B) as k x n), widened once.
  template <class Acc>
  std::vector<Acc> operand(const void* data, cudaDataType type, int ld, cublasOperation_t op,
                           int rows, int cols) const {
    std::vector<Acc> out(static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols));
    for (int j = 0; j < cols; ++j) {
      for (int i = 0; i < rows; ++i) {
        const std::size_t index =
            op == CUBLAS_OP_N ? static_cast<std::size_t>(i) + std::size_t(j) * std::size_t(ld)
                              : static_cast<std::size_t>(j) + std::size_t(i) * std::size_t(ld);
        out[static_cast<std::size_t>(i) + std::size_t(j) * std::size_t(rows)] =
            static_cast<Acc>(load(data, type, index));
      }
    }
    return out;
  }

  template <class Acc>
  void run_with() const {
    const std::vector<Acc> left = operand<Acc>(a, a_type, lda, transa, m, k);
    const std::vector<Acc> right = operand<Acc>(b, b_type, ldb, transb, k, n);
    std::vector<Acc> column(static_cast<std::size_t>(m));
    for (int j = 0; j < n; ++j) {
      std::fill(column.begin(), column.end(), Acc{0});
      for (int p = 0; p < k; ++p) {
        const Acc scale = right[static_cast<std::size_t>(p) + std::size_t(j) * std::size_t(k)];
        const Acc* from = left.data() + std::size_t(p) * std::size_t(m);
        for (int i = 0; i < m; ++i) column[static_cast<std::size_t>(i)] += from[i] * scale;
      }
      for (int i = 0; i < m; ++i) {
        const std::size_t index = static_cast<std::size_t>(i) + std::size_t(j) * std::size_t(ldc);
        Acc value = static_cast<Acc>(alpha) * column[static_cast<std::size_t>(i)];
        if (beta != 0) value += static_cast<Acc>(beta) * static_cast<Acc>(load(c, c_type, index));
        store(c, c_type, index, static_cast<double>(value));
      }
    }
  }

  void run() const {
    if (double_accumulation) {
      run_with<double>();
    } else {
      run_with<float>();
    }
  }
};

bool known_operation(cublasOperation_t op) {
  return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C;  // real types: C is T
}

/// Which type combinations run, as cuBLAS's cublasGemmEx table lists them for real types.
bool supported(cudaDataType ab, cudaDataType c, cublasComputeType_t compute) {
  switch (compute) {
    case CUBLAS_COMPUTE_32F:
    case CUBLAS_COMPUTE_32F_PEDANTIC:
    case CUBLAS_COMPUTE_32F_FAST_16F:
    case CUBLAS_COMPUTE_32F_FAST_16BF:
    case CUBLAS_COMPUTE_32F_FAST_TF32:
      return (ab == CUDA_R_32F && c == CUDA_R_32F) ||
             ((ab == CUDA_R_16F || ab == CUDA_R_16BF) && (c == ab || c == CUDA_R_32F));
    case CUBLAS_COMPUTE_64F:
    case CUBLAS_COMPUTE_64F_PEDANTIC:
      return ab == CUDA_R_64F && c == CUDA_R_64F;
    default:
      return false;
  }
}

cublasStatus_t gemm(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                    int m, int n, int k, const void* alpha, const void* a, cudaDataType a_type,
                    int lda, const void* b, cudaDataType b_type, int ldb, const void* beta, void* c,
                    cudaDataType c_type, int ldc, cublasComputeType_t compute) {
  if (admit() != cudaSuccess || !live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!known_operation(transa) || !known_operation(transb) || m < 0 || n < 0 || k < 0 ||
      alpha == nullptr || beta == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const int a_rows = transa == CUBLAS_OP_N ? m : k;
  const int b_rows = transb == CUBLAS_OP_N ? k : n;
  if (lda < std::max(1, a_rows) || ldb < std::max(1, b_rows) || ldc < std::max(1, m)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (a_type != b_type || !supported(a_type, c_type, compute)) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const bool wide = compute == CUBLAS_COMPUTE_64F || compute == CUBLAS_COMPUTE_64F_PEDANTIC;
  Stream* stream = nullptr;
  if (resolve(handle->stream, stream, false) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  Gemm job{transa, transb, m, n, k, a, a_type, lda, b, b_type, ldb, c, c_type, ldc, wide, 0, 0};
  const auto scalar = [wide](const void* value) {
    return wide ? *static_cast<const double*>(value)
                : static_cast<double>(*static_cast<const float*>(value));
  };
  auto task = std::make_unique<Task>();
  if (handle->pointer_mode == CUBLAS_POINTER_MODE_HOST) {  // read now, as cuBLAS does
    job.alpha = scalar(alpha);
    job.beta = scalar(beta);
    task->work = [job](const TaskContext&) { job.run(); };
  } else {  // device pointers: read when the stream gets there
    task->work = [job, alpha, beta, scalar](const TaskContext&) mutable {
      job.alpha = scalar(alpha);
      job.beta = scalar(beta);
      job.run();
    };
  }
  if (enqueue(*stream, std::move(task)) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (admit() != cudaSuccess) return CUBLAS_STATUS_NOT_INITIALIZED;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  auto* made = new cublasContext{device};
  Handles& all = handles();
  const std::lock_guard lock(all.mutex);
  all.live.insert(made);
  *handle = made;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  Handles& all = handles();
  {
    const std::lock_guard lock(all.mutex);
    if (handle == nullptr || all.live.erase(handle) == 0) return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  delete handle;  // its queued GEMMs hold copies of what they need
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t streamId) {
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = streamId;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream_v2(cublasHandle_t handle, cudaStream_t* streamId) {
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (streamId == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *streamId = handle->stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t mode) {
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode != CUBLAS_POINTER_MODE_HOST && mode != CUBLAS_POINTER_MODE_DEVICE) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  handle->pointer_mode = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t* mode) {
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = handle->pointer_mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->math_mode = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t* mode) {
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = handle->math_mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* /*workspace*/,
                                     size_t /*workspaceSizeInBytes*/) {
  return live(handle) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t /*algo*/) {
  return gemm(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
              ldc, computeType);
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa,
                              cublasOperation_t transb, int m, int n, int k, const float* alpha,
                              const float* A, int lda, const float* B, int ldb, const float* beta,
                              float* C, int ldc) {
  return gemm(handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, B, CUDA_R_32F, ldb, beta,
              C, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F);
}

cublasStatus_t cublasDgemm_v2(cublasHandle_t handle, cublasOperation_t transa,
                              cublasOperation_t transb, int m, int n, int k, const double* alpha,
                              const double* A, int lda, const double* B, int ldb,
                              const double* beta, double* C, int ldc) {
  return gemm(handle, transa, transb, m, n, k, alpha, A, CUDA_R_64F, lda, B, CUDA_R_64F, ldb, beta,
              C, CUDA_R_64F, ldc, CUBLAS_COMPUTE_64F);
}

const char* cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "an absent device architectural feature is required";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "the functionality requested is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "an error was detected when checking the license";
  }
  return "unknown cuBLAS status";
}

}  // extern "C"
