// cuBLAS's GEMM on the simulated streams, against a naive column-major reference: transposes,
// leading dimensions, alpha and beta (beta == 0 ignores C, even NaN), fp32/fp16/bf16 inputs.
#include <cublas_v2.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "sim_test.hpp"

using sim_test::ScopedStream;

namespace {

// The test's values are multiples of 1/4 in [-2, 2]: exact in fp16, bf16 and fp32, so every
// conversion below is exact and the reference needs no rounding model.
std::uint16_t to_half(float value) {
  if (value == 0.0f) return 0;
  std::uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  const int exponent = static_cast<int>((bits >> 23) & 0xFFu) - 127 + 15;
  return static_cast<std::uint16_t>(sign | (static_cast<std::uint32_t>(exponent) << 10) |
                                    ((bits >> 13) & 0x3FFu));
}

float from_half(std::uint16_t half) {
  if ((half & 0x7FFFu) == 0) return 0.0f;
  const std::uint32_t sign = static_cast<std::uint32_t>(half & 0x8000u) << 16;
  const std::uint32_t exponent = ((half >> 10) & 0x1Fu) - 15 + 127;
  const std::uint32_t bits =
      sign | (exponent << 23) | (static_cast<std::uint32_t>(half & 0x3FFu) << 13);
  float value = 0;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

std::uint16_t to_bfloat16(float value) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return static_cast<std::uint16_t>(bits >> 16);
}

struct Case {
  cublasOperation_t ta, tb;
  int m, n, k, lda, ldb, ldc;
};

/// Column-major m x n = op(A) op(B) with op(A) m x k, from float copies of the inputs.
std::vector<double> reference(const Case& c, const std::vector<float>& a,
                              const std::vector<float>& b, double alpha, double beta,
                              const std::vector<float>& c0) {
  std::vector<double> out(static_cast<std::size_t>(c.ldc * c.n));
  for (int j = 0; j < c.n; ++j) {
    for (int i = 0; i < c.m; ++i) {
      double sum = 0;
      for (int p = 0; p < c.k; ++p) {
        const float x = c.ta == CUBLAS_OP_N ? a[static_cast<std::size_t>(i + p * c.lda)]
                                            : a[static_cast<std::size_t>(p + i * c.lda)];
        const float y = c.tb == CUBLAS_OP_N ? b[static_cast<std::size_t>(p + j * c.ldb)]
                                            : b[static_cast<std::size_t>(j + p * c.ldb)];
        sum += static_cast<double>(x) * static_cast<double>(y);
      }
      const auto index = static_cast<std::size_t>(i + j * c.ldc);
      out[index] = alpha * sum + (beta != 0 ? beta * c0[index] : 0.0);
    }
  }
  return out;
}

template <class T>
T* to_device(const std::vector<T>& host) {
  T* device = nullptr;
  SIM_REQUIRE(cudaMalloc(reinterpret_cast<void**>(&device), host.size() * sizeof(T)));
  SIM_REQUIRE(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return device;
}

template <class T>
std::vector<T> to_host(const T* device, std::size_t count) {
  std::vector<T> host(count);
  SIM_REQUIRE(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

/// A cuBLAS handle made and destroyed with the test.
class Blas {
 public:
  Blas() { REQUIRE(cublasCreate(&handle_) == CUBLAS_STATUS_SUCCESS); }
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;
  ~Blas() { (void)cublasDestroy(handle_); }
  operator cublasHandle_t() const { return handle_; }  // NOLINT: a handle is its handle

 private:
  cublasHandle_t handle_ = nullptr;
};

/// Runs one GEMM case with A and B stored as `type`, C as fp32 (or fp16 when `half_output`),
/// and compares with the reference.
void check_case(cublasHandle_t blas, cudaStream_t stream, const Case& c, cudaDataType type,
                bool half_output, float alpha, float beta, std::mt19937& random) {
  CAPTURE(c.ta);
  CAPTURE(c.tb);
  CAPTURE(type);
  CAPTURE(half_output);
  CAPTURE(beta);
  std::uniform_int_distribution<int> quarters(-8, 8);
  const int a_cols = c.ta == CUBLAS_OP_N ? c.k : c.m;
  const int b_cols = c.tb == CUBLAS_OP_N ? c.n : c.k;
  std::vector<float> a(static_cast<std::size_t>(c.lda * a_cols));
  std::vector<float> b(static_cast<std::size_t>(c.ldb * b_cols));
  std::vector<float> c0(static_cast<std::size_t>(c.ldc * c.n));
  for (auto* values : {&a, &b, &c0}) {
    for (float& value : *values) value = static_cast<float>(quarters(random)) / 4.0f;
  }
  void* device_a = nullptr;
  void* device_b = nullptr;
  if (type == CUDA_R_32F) {
    device_a = to_device(a);
    device_b = to_device(b);
  } else {
    std::vector<std::uint16_t> a16(a.size()), b16(b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      a16[i] = type == CUDA_R_16F ? to_half(a[i]) : to_bfloat16(a[i]);
    }
    for (std::size_t i = 0; i < b.size(); ++i) {
      b16[i] = type == CUDA_R_16F ? to_half(b[i]) : to_bfloat16(b[i]);
    }
    device_a = to_device(a16);
    device_b = to_device(b16);
  }
  void* device_c = nullptr;
  if (half_output) {
    std::vector<std::uint16_t> c16(c0.size());
    for (std::size_t i = 0; i < c0.size(); ++i) c16[i] = to_half(c0[i]);
    device_c = to_device(c16);
  } else if (beta != 0.0f) {
    device_c = to_device(c0);
  } else {  // beta == 0: C is not read, so its NaN (fresh device memory) must not show
    SIM_REQUIRE(cudaMalloc(&device_c, c0.size() * sizeof(float)));
  }
  REQUIRE(cublasSetStream(blas, stream) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(cublasGemmEx(blas, c.ta, c.tb, c.m, c.n, c.k, &alpha, device_a, type, c.lda, device_b,
                       type, c.ldb, &beta, device_c, half_output ? CUDA_R_16F : CUDA_R_32F, c.ldc,
                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  SIM_REQUIRE(cudaStreamSynchronize(stream));
  const std::vector<double> want = reference(c, a, b, alpha, beta, c0);
  std::vector<float> got(c0.size());
  if (half_output) {
    const auto raw = to_host(static_cast<const std::uint16_t*>(device_c), c0.size());
    for (std::size_t i = 0; i < raw.size(); ++i) got[i] = from_half(raw[i]);
  } else {
    got = to_host(static_cast<const float*>(device_c), c0.size());
  }
  for (int j = 0; j < c.n; ++j) {
    for (int i = 0; i < c.m; ++i) {
      const auto index = static_cast<std::size_t>(i + j * c.ldc);
      CAPTURE(i);
      CAPTURE(j);
      CHECK(got[index] == doctest::Approx(want[index]).epsilon(1e-6));
    }
  }
  for (void* pointer : {device_a, device_b, device_c}) SIM_REQUIRE(cudaFree(pointer));
}

}  // namespace

TEST_CASE("cublasGemmEx matches a naive reference for every transpose and input type") {
  Blas blas;
  ScopedStream stream;
  std::mt19937 random(29);
  for (const cublasOperation_t ta : {CUBLAS_OP_N, CUBLAS_OP_T}) {
    for (const cublasOperation_t tb : {CUBLAS_OP_N, CUBLAS_OP_T}) {
      Case c{ta, tb, 5, 7, 3, 0, 0, 9};
      c.lda = (ta == CUBLAS_OP_N ? c.m : c.k) + 2;  // padded leading dimensions
      c.ldb = (tb == CUBLAS_OP_N ? c.k : c.n) + 1;
      for (const cudaDataType type : {CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF}) {
        check_case(blas, stream, c, type, false, 1.0f, 0.0f, random);
        check_case(blas, stream, c, type, false, 2.0f, 0.5f, random);
      }
      check_case(blas, stream, c, CUDA_R_16F, true, 1.0f, 1.0f, random);
    }
  }
}

TEST_CASE("cublasSgemm with alpha and beta in device memory (CUBLAS_POINTER_MODE_DEVICE)") {
  Blas blas;
  const std::vector<float> a{1, 2, 3, 4}, b{5, 6, 7, 8}, c{1, 1, 1, 1};  // 2 x 2, column-major
  float* device_a = to_device(a);
  float* device_b = to_device(b);
  float* device_c = to_device(c);
  float* scalars = to_device(std::vector<float>{2.0f, 10.0f});
  REQUIRE(cublasSetPointerMode(blas, CUBLAS_POINTER_MODE_DEVICE) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, scalars, device_a, 2, device_b, 2,
                      scalars + 1, device_c, 2) == CUBLAS_STATUS_SUCCESS);
  SIM_REQUIRE(cudaDeviceSynchronize());
  // A B = [[1 3][2 4]] [[5 7][6 8]] = [[23 31][34 46]] (column-major: 23, 34, 31, 46).
  CHECK(to_host(device_c, 4) == std::vector<float>{56, 78, 72, 102});
  for (float* pointer : {device_a, device_b, device_c, scalars}) SIM_REQUIRE(cudaFree(pointer));
}

TEST_CASE("cuBLAS's errors") {
  Blas blas;
  const float one = 1.0f;
  float* data = to_device(std::vector<float>(16, 1.0f));
  CHECK(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, -1, 2, 2, &one, data, CUDA_R_32F, 2, data,
                     CUDA_R_32F, 2, &one, data, CUDA_R_32F, 2, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE);
  CHECK(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, 4, 2, 2, &one, data, CUDA_R_32F, 2, data,
                     CUDA_R_32F, 2, &one, data, CUDA_R_32F, 4, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE);  // lda < m
  CHECK(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one, data, CUDA_R_32F, 2, data,
                     CUDA_R_16F, 2, &one, data, CUDA_R_32F, 2, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_NOT_SUPPORTED);  // mixed A and B
  CHECK(cublasGemmEx(nullptr, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one, data, CUDA_R_32F, 2, data,
                     CUDA_R_32F, 2, &one, data, CUDA_R_32F, 2, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_NOT_INITIALIZED);
  CHECK(std::string(cublasGetStatusName(CUBLAS_STATUS_NOT_SUPPORTED)) ==
        "CUBLAS_STATUS_NOT_SUPPORTED");
  CHECK(std::string(cublasGetStatusString(CUBLAS_STATUS_SUCCESS)) == "success");
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(1);
  REQUIRE(cublasGetStream(blas, &stream) == CUBLAS_STATUS_SUCCESS);
  CHECK(stream == nullptr);  // a new handle works on the default stream
  SIM_REQUIRE(cudaFree(data));
}
