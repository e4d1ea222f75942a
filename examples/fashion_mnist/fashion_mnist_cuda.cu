// fashion_mnist_cuda: the flagship on GPUs. The same model, initialisation and recipe as
// fashion_mnist.cpp (recipe.hpp: SGD with the head at twice the learning rate, warm-up + cosine,
// an EMA evaluated at each epoch's end), with what a PyTorch user adds on a GPU:
// - O2 mixed precision: fp32 master weights in the Parameters arena, a half (or bfloat16) compute
//   copy cast from them once per step (tandem::amp::ComputeWeights), matrix products through
//   cuBLAS with half inputs and fp32 accumulation; BatchNorm in fp32 (apex's keep_batchnorm_fp32).
//   The weight gradients come out of cuBLAS's fp32 accumulators straight into the fp32 master
//   gradients (no half rounding, no cast pass); activation gradients travel in the compute type.
// - GradScaler (fp16 only: bfloat16 has fp32's range): the loss gradient is scaled, the master
//   gradients unscaled and checked for inf/NaN in one pass, a step with inf or NaN is skipped.
// - The Loader's asynchronous copies (cuda_delivery: pinned staging, copies on their own stream,
//   the training stream waits on an event), or --resident: the whole data set on the GPU as bytes,
//   each batch gathered and normalised there by a kernel (PyTorch's fastest variant).
// - DDP with overlap and SyncBatchNorm over NCCL (one GPU per rank, the default), or over Gloo or
//   threads (LocalComm) with device tensors staged through pinned memory (several ranks may then
//   share one GPU).
//   build/dev/examples/fashion_mnist/fashion_mnist_cuda                        1 GPU, NCCL
//   build/dev/tools/tandemrun --nproc-per-node 4
//   build/dev/examples/fashion_mnist/fashion_mnist_cuda
//   build/dev/examples/fashion_mnist/fashion_mnist_cuda --backend local --ranks 2   2 threads, 1
//   GPU
// Flags: those of fashion_mnist, plus --precision fp16|bf16|fp32 (default fp16), --resident,
// --min-accuracy PCT (the test: exit 1 unless the run trained; see check_run) and --eval-samples N
// (evaluate on the first N test samples only: the simulated GPU's test under ThreadSanitizer).
// Without a GPU it prints why and exits 77. Checkpoints (--checkpoint-dir, --resume) work on every
// backend.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <signal.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "common/run.hpp"
#include "recipe.hpp"
#include "tandem/amp/grad_scaler.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/comm/metrics.hpp"
#include "tandem/core/env.hpp"
#include "tandem/core/world.hpp"
#include "tandem/cuda.hpp"
#include "tandem/data/batches.hpp"
#include "tandem/data/cuda_delivery.hpp"
#include "tandem/data/loader.hpp"
#include "tandem/data/mnist.hpp"
#include "tandem/data/sampler.hpp"
#include "tandem/ddp/ddp.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/io/log.hpp"
#include "tandem/io/progress.hpp"
#include "tandem/io/tensorboard.hpp"
#include "tandem/nn/sync_batch_norm.hpp"
#include "tandem/optim/ema.hpp"
#include "tandem/optim/lr_scheduler.hpp"
#include "tandem/optim/sgd.hpp"
#include "tandem/tensor/precision.hpp"
#if TANDEM_EXAMPLE_WITH_GLOO || TANDEM_EXAMPLE_WITH_NCCL
#include "tandem/comm/init.hpp"
#endif
#if TANDEM_EXAMPLE_WITH_GLOO
#include "tandem/comm/gloo/gloo.hpp"
#endif
#if TANDEM_EXAMPLE_WITH_NCCL
#include "tandem/comm/nccl/nccl.hpp"
#endif

namespace {

using fashion_mnist::classes;
using fashion_mnist::pixels;
using fashion_mnist::Settings;
using tandem::device;

enum class Precision { fp16, bf16, fp32 };

Precision precision_of(const Settings& settings) {
  if (settings.precision == "bf16") return Precision::bf16;
  if (settings.precision == "fp32") return Precision::fp32;
  return Precision::fp16;
}

/// apex O2's weights (a Low compute copy of fp32 masters) with fp32 weight gradients: cuBLAS
/// accumulates them in fp32 and writes them into the master gradients directly. Loss scaling for
/// half only, as O2.
template <class Low>
struct O2MasterGrads
    : tandem::amp::precision<float, Low, float, float, std::same_as<Low, tandem::half>> {};

void check_blas(cublasStatus_t status, const char* operation) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw tandem::Error(operation, std::string("cuBLAS: ") + cublasGetStatusName(status) + ": " +
                                       cublasGetStatusString(status));
  }
}

/// One cuBLAS handle, on the current GPU, issuing on `stream`.
class Blas {
 public:
  explicit Blas(cudaStream_t stream) {
    check_blas(cublasCreate(&handle_), "cublasCreate");
    check_blas(cublasSetStream(handle_, stream), "cublasSetStream");
  }
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;
  ~Blas() { (void)cublasDestroy(handle_); }
  [[nodiscard]] cublasHandle_t get() const noexcept { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

// --- kernels: cuda_exec functors, one index per output element (or per sample / per column),
// nothing clever. As functors (TANDEM_HD operator()) they run as kernels on a GPU and as host
// functions on tandem's simulated CUDA runtime (the cuda-sim tests), in the same stream order.

/// Images already normalised in device memory (a Loader batch), row r at x + r * width.
struct FloatRows {
  const float* x;
  TANDEM_HD float operator()(std::size_t row, std::size_t column, std::size_t width) const {
    return x[row * width + column];
  }
};

/// The raw bytes of a whole data set on the device, normalised through the data set's own
/// 256-entry table (the floats its host gather produces, bit for bit).
struct ByteRows {
  const std::uint8_t* bytes;
  const float* table;
  TANDEM_HD float operator()(std::size_t row, std::size_t column, std::size_t width) const {
    return table[bytes[row * width + column]];
  }
};

/// A batch's labels: a Loader batch's own (batch[s]), or a resident data set's (all[index[s]]).
struct Labels {
  const std::int64_t* batch;
  const std::uint8_t* all;
  const std::int64_t* index;
  TANDEM_HD int operator()(std::size_t s) const {
    return batch ? static_cast<int>(batch[s]) : static_cast<int>(all[index[s]]);
  }
};

/// out[s][p] = C(rows(index ? index[s] : s, p)): the batch's images in the compute type; one
/// index per pixel.
template <class Rows, class C>
struct GatherImages {
  Rows rows;
  const std::int64_t* index;
  std::size_t width;
  C* out;
  TANDEM_HD void operator()(std::size_t i) const {
    const std::size_t s = i / width;
    const std::size_t row = index ? static_cast<std::size_t>(index[s]) : s;
    out[i] = C(rows(row, i % width, width));
  }
};

/// y[s][j] += bias[j]; one index per element of y.
struct AddBias {
  float* y;
  const float* bias;
  std::size_t width;
  TANDEM_HD void operator()(std::size_t i) const { y[i] += bias[i % width]; }
};

/// out = C(max(x, 0)).
template <class C>
struct ReluToCompute {
  const float* x;
  C* out;
  TANDEM_HD void operator()(std::size_t i) const { out[i] = C(x[i] > 0.0f ? x[i] : 0.0f); }
};

/// grad = 0 where ReLU's input was not positive.
struct ReluBackward {
  float* grad;
  const float* input;
  TANDEM_HD void operator()(std::size_t i) const {
    if (!(input[i] > 0.0f)) grad[i] = 0.0f;
  }
};

/// One index per sample: softmax cross-entropy of logits[s] (bias included) against its label.
/// loss[s] = the sample's loss; the gradient of scale * mean loss, (p - onehot) * scale / count,
/// into grad32 (fp32) and grad (compute type); the first largest logit being the label counts
/// into *hit_total when given (atomically: samples run in parallel).
template <class C>
struct CrossEntropy {
  const float* logits;
  Labels labels;
  std::size_t count;
  int width;
  float scale;
  float* grad32;
  C* grad;
  float* loss;
  int* hit_total;

  TANDEM_HD void operator()(std::size_t s) const {
    const float* z = logits + s * static_cast<std::size_t>(width);
    int best = 0;
    for (int k = 1; k < width; ++k) best = z[k] > z[best] ? k : best;
    const float top = z[best];
    double sum = 0;
    for (int k = 0; k < width; ++k) sum += exp(static_cast<double>(z[k] - top));
    const int label = labels(s);
    loss[s] = static_cast<float>(log(sum) - static_cast<double>(z[label] - top));
    if (hit_total && best == label) {
#if defined(__CUDA_ARCH__)
      atomicAdd(hit_total, 1);
#else
      __atomic_fetch_add(hit_total, 1, __ATOMIC_RELAXED);
#endif
    }
    for (int k = 0; k < width; ++k) {
      const double p = exp(static_cast<double>(z[k] - top)) / sum;
      const auto g = static_cast<float>((p - (k == label ? 1.0 : 0.0)) *
                                        static_cast<double>(scale) / static_cast<double>(count));
      grad32[s * static_cast<std::size_t>(width) + static_cast<std::size_t>(k)] = g;
      grad[s * static_cast<std::size_t>(width) + static_cast<std::size_t>(k)] = C(g);
    }
  }
};

/// One index per column j: sums[j] += sum over s of grad[s][j] (a bias gradient) and, when `out`
/// is given, out[s][j] = C(grad[s][j]).
template <class C>
struct ColumnSums {
  const float* grad;
  std::size_t count;
  std::size_t width;
  float* sums;
  C* out;
  TANDEM_HD void operator()(std::size_t j) const {
    float total = 0.0f;
    for (std::size_t s = 0; s < count; ++s) {
      const float g = grad[s * width + j];
      total += g;
      if (out) out[s * width + j] = C(g);
    }
    sums[j] += total;
  }
};

/// A float-sized activation buffer holding compute-type (C) elements.
template <class C>
C* as(tandem::Buffer<float, device>& buffer) {
  return reinterpret_cast<C*>(buffer.data());
}

/// The data set's raw bytes, labels and normalisation table in device memory.
struct ResidentData {
  tandem::Buffer<std::uint8_t, device> bytes;
  tandem::Buffer<std::uint8_t, device> labels;
  tandem::Buffer<float, device> table;
  std::size_t size = 0;

  ResidentData(const tandem::FashionMNIST& data, cudaStream_t stream)
      : bytes(data.pixels().size()), labels(data.labels().size()), table(256), size(data.size()) {
    std::vector<float> host_table(256);
    for (unsigned v = 0; v < 256; ++v) {
      // The data set's own formula (torchvision's: ToTensor then Normalize, in float).
      host_table[v] = (static_cast<float>(v) / 255.0f - data.mean()) / data.std();
    }
    upload(bytes.data(), data.pixels().data(), data.pixels().size(), stream);
    upload(labels.data(), data.labels().data(), data.labels().size(), stream);
    upload(table.data(), host_table.data(), 256 * sizeof(float), stream);
    tandem::cuda::check(cudaStreamSynchronize(stream), "ResidentData (cudaStreamSynchronize)");
  }
  ByteRows rows() const { return {bytes.data(), table.data()}; }

  static void upload(void* to, const void* from, std::size_t bytes_count, cudaStream_t stream) {
    tandem::cuda::check(cudaMemcpyAsync(to, from, bytes_count, cudaMemcpyHostToDevice, stream),
                        "ResidentData (cudaMemcpyAsync)");
  }
};

/// Host indices (a sampler's list) copied into device memory.
tandem::Buffer<std::int64_t, device> device_indices(const std::vector<std::int64_t>& indices,
                                                    cudaStream_t stream) {
  tandem::Buffer<std::int64_t, device> out(std::max<std::size_t>(indices.size(), 1));
  tandem::cuda::check(
      cudaMemcpyAsync(out.data(), indices.data(), indices.size() * sizeof(std::int64_t),
                      cudaMemcpyHostToDevice, stream),
      "device_indices (cudaMemcpyAsync)");
  tandem::cuda::check(cudaStreamSynchronize(stream), "device_indices (cudaStreamSynchronize)");
  return out;
}

/// The model: fc1 -> SyncBatchNorm -> ReLU -> fc2 on one GPU, the names of fashion_mnist.cpp's
/// (PyTorch's). Every kernel and cuBLAS call runs on one stream, in order; nothing waits on the
/// host except where a value is read back.
template <class Comm>
class Mlp {
 public:
  using BatchNorm = tandem::SyncBatchNorm<Comm, float, device, tandem::cuda_exec>;

  Mlp(Comm& comm, std::size_t hidden, std::uint64_t seed, Precision precision,
      std::size_t max_batch, cudaStream_t stream)
      : hidden_(hidden), precision_(precision), exec_{stream}, blas_(stream) {
    const auto h = static_cast<std::int64_t>(hidden);
    fc1_w_ = &params_.add("fc1.weight", {h, static_cast<std::int64_t>(pixels)});
    fc1_b_ = &params_.add("fc1.bias", {h});
    bn_.emplace(comm, params_, "bn1.", h, tandem::SyncBatchNormOptions{}, exec_);
    fc2_w_ = &params_.add("fc2.weight", {static_cast<std::int64_t>(classes), h});
    fc2_b_ = &params_.add("fc2.bias", {static_cast<std::int64_t>(classes)});
    params_.finalize(exec_);
    bn_->reset_parameters();
    const auto init = fashion_mnist::linear_init(hidden, seed);  // the CPU example's numbers
    upload(*fc1_w_, init.fc1_weight);
    upload(*fc1_b_, init.fc1_bias);
    upload(*fc2_w_, init.fc2_weight);
    upload(*fc2_b_, init.fc2_bias);
    exec_.synchronize();  // the host vectors go out of scope

    const std::size_t numel = params_.numel();
    switch (precision_) {
      case Precision::fp16:
        half_weights_.emplace(numel);
        break;
      case Precision::bf16:
        bfloat16_weights_.emplace(numel);
        break;
      case Precision::fp32:
        float_weights_.emplace(numel);
        break;
    }
    // Activations; those in the compute type live in float-sized buffers (room for any of them).
    const std::size_t wide = max_batch * hidden_;
    for (auto* b : {&h1_, &bn_out_, &drelu_, &dh1_}) *b = tandem::Buffer<float, device>(wide);
    for (auto* b : {&act_c_, &dh1_c_}) *b = tandem::Buffer<float, device>(wide);
    x_c_ = tandem::Buffer<float, device>(max_batch * pixels);
    logits_ = tandem::Buffer<float, device>(max_batch * classes);
    d32_ = tandem::Buffer<float, device>(max_batch * classes);
    d_c_ = tandem::Buffer<float, device>(max_batch * classes);
    loss_ = tandem::Buffer<float, device>(max_batch);
    hits_ = tandem::Buffer<int, device>(1);
    max_batch_ = max_batch;
  }

  tandem::Parameters<float, device>& params() { return params_; }
  BatchNorm& batch_norm() { return *bn_; }
  [[nodiscard]] const tandem::cuda_exec& exec() const { return exec_; }

  /// The compute copy of the weights from the fp32 masters: one cast pass (nothing for fp32).
  void refresh_weights() {
    if (half_weights_) half_weights_->refresh(exec_, params_.values());
    if (bfloat16_weights_) bfloat16_weights_->refresh(exec_, params_.values());
    if (float_weights_) float_weights_->refresh(exec_, params_.values());
  }

  /// Logits of `count` images (rows(index[s]) or rows(s)) into logits_, bias added.
  template <class Rows>
  void forward(Rows rows, const std::int64_t* index, std::size_t count) {
    require_batch(count);
    const int n = static_cast<int>(count);
    const int h = static_cast<int>(hidden_);
    with_compute_type([&]<class C>(C*) {
      tandem::for_each_index(exec_, count * pixels,
                             GatherImages<Rows, C>{rows, index, pixels, as<C>(x_c_)});
    });
    // Row-major h1[n][H] = x[n][784] W1[H][784]^T; column-major that is h1^T = W1 x^T.
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, h, n, int(pixels), weights(*fc1_w_), int(pixels), x_c_.data(),
         int(pixels), 0.0f, h1_.data(), h);
    tandem::for_each_index(exec_, count * hidden_,
                           AddBias{h1_.data(), fc1_b_->value().data(), hidden_});
    bn_->forward(tandem::View<const float, device>(h1_.data(), shape(count)),
                 tandem::View<float, device>(bn_out_.data(), shape(count)));
    with_compute_type([&]<class C>(C*) {
      tandem::for_each_index(exec_, count * hidden_,
                             ReluToCompute<C>{bn_out_.data(), as<C>(act_c_)});
    });
    // logits[n][10] = a[n][H] W2[10][H]^T.
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, int(classes), n, h, weights(*fc2_w_), h, act_c_.data(), h, 0.0f,
         logits_.data(), int(classes));
    tandem::for_each_index(exec_, count * classes,
                           AddBias{logits_.data(), fc2_b_->value().data(), classes});
  }

  /// The cross-entropy of the last forward: per-sample losses into loss_ (and correct answers
  /// counted into the hit counter when `count_hits`), the gradient of scale * mean loss into
  /// d32_ and d_c_.
  void loss(Labels labels, std::size_t count, float scale, bool count_hits) {
    with_compute_type([&]<class C>(C*) {
      tandem::for_each_index(
          exec_, count,
          CrossEntropy<C>{logits_.data(), labels, count, int(classes), scale, d32_.data(),
                          as<C>(d_c_), loss_.data(), count_hits ? hits_.data() : nullptr});
    });
  }

  /// The gradients of the last loss() added into the arena (scaled), each handed to
  /// ready(param) once complete, in fashion_mnist.cpp's order.
  template <class Ready>
  void backward(std::size_t count, Ready&& ready) {
    const int n = static_cast<int>(count);
    const int h = static_cast<int>(hidden_);
    // dW2[10][H] += d[n][10]^T a[n][H]; column-major dW2^T = a^T d.
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, h, int(classes), n, act_c_.data(), h, d_c_.data(), int(classes),
         1.0f, fc2_w_->grad().data(), h);
    tandem::for_each_index(
        exec_, classes,
        ColumnSums<float>{d32_.data(), count, classes, fc2_b_->grad().data(), nullptr});
    ready(*fc2_w_);
    ready(*fc2_b_);
    // drelu[n][H] = d[n][10] W2[10][H]; column-major drelu^T = W2^T d^T.
    gemm(CUBLAS_OP_N, CUBLAS_OP_N, h, n, int(classes), weights(*fc2_w_), h, d_c_.data(),
         int(classes), 0.0f, drelu_.data(), h);
    tandem::for_each_index(exec_, count * hidden_, ReluBackward{drelu_.data(), bn_out_.data()});
    bn_->backward(tandem::View<const float, device>(h1_.data(), shape(count)),
                  tandem::View<const float, device>(drelu_.data(), shape(count)),
                  tandem::View<float, device>(dh1_.data(), shape(count)));
    ready(params_["bn1.weight"]);
    ready(params_["bn1.bias"]);
    with_compute_type([&]<class C>(C*) {
      tandem::for_each_index(
          exec_, hidden_,
          ColumnSums<C>{dh1_.data(), count, hidden_, fc1_b_->grad().data(), as<C>(dh1_c_)});
    });
    // dW1[H][784] += dh1[n][H]^T x[n][784]; column-major dW1^T = x^T dh1.
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, int(pixels), h, n, x_c_.data(), int(pixels), dh1_c_.data(), h,
         1.0f, fc1_w_->grad().data(), int(pixels));
    ready(*fc1_w_);
    ready(*fc1_b_);
  }

  /// The mean of the last loss()'s per-sample losses (waits for the stream).
  double mean_loss(std::size_t count) {
    std::vector<float> host(count);
    tandem::cuda::check(cudaMemcpyAsync(host.data(), loss_.data(), count * sizeof(float),
                                        cudaMemcpyDeviceToHost, exec_.stream),
                        "mean_loss (cudaMemcpyAsync)");
    exec_.synchronize();
    double sum = 0;
    for (float v : host) sum += v;
    return sum / static_cast<double>(count);
  }

  void reset_hits() {
    tandem::cuda::check(cudaMemsetAsync(hits_.data(), 0, sizeof(int), exec_.stream),
                        "cudaMemsetAsync");
  }
  /// The hit counter (waits for the stream).
  std::int64_t hits() {
    int host = 0;
    tandem::cuda::check(
        cudaMemcpyAsync(&host, hits_.data(), sizeof(int), cudaMemcpyDeviceToHost, exec_.stream),
        "hits (cudaMemcpyAsync)");
    exec_.synchronize();
    return host;
  }

 private:
  template <class F>
  void with_compute_type(F&& f) {
    switch (precision_) {
      case Precision::fp16:
        f(static_cast<tandem::half*>(nullptr));
        break;
      case Precision::bf16:
        f(static_cast<tandem::bfloat16*>(nullptr));
        break;
      case Precision::fp32:
        f(static_cast<float*>(nullptr));
        break;
    }
  }
  cudaDataType_t compute_type() const {
    switch (precision_) {
      case Precision::fp16:
        return CUDA_R_16F;
      case Precision::bf16:
        return CUDA_R_16BF;
      case Precision::fp32:
        break;
    }
    return CUDA_R_32F;
  }
  /// The compute copy of parameter p (refresh_weights() made it).
  const void* weights(const tandem::Parameters<float, device>::Parameter& p) {
    const std::size_t offset = p.offset();
    if (half_weights_) return half_weights_->values().data() + offset;
    if (bfloat16_weights_) return bfloat16_weights_->values().data() + offset;
    return float_weights_->values().data() + offset;
  }
  /// C = A B + beta C, column-major (cublasGemmEx): A and B in the compute type, C in fp32,
  /// accumulated in fp32 (for fp32 inputs: plain fp32, no TF32).
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* a, int lda,
            const void* b, int ldb, float beta, float* c, int ldc) {
    const float alpha = 1.0f;
    check_blas(cublasGemmEx(blas_.get(), ta, tb, m, n, k, &alpha, a, compute_type(), lda, b,
                            compute_type(), ldb, &beta, c, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx");
  }
  void upload(tandem::Parameters<float, device>::Parameter& p, const std::vector<float>& values) {
    tandem::cuda::check(
        cudaMemcpyAsync(p.value().data(), values.data(), values.size() * sizeof(float),
                        cudaMemcpyHostToDevice, exec_.stream),
        "Mlp (cudaMemcpyAsync of the initial weights)");
  }
  tandem::Shape shape(std::size_t count) const {
    return tandem::Shape{static_cast<std::int64_t>(count), static_cast<std::int64_t>(hidden_)};
  }
  void require_batch(std::size_t count) const {
    if (count == 0 || count > max_batch_) {
      throw tandem::Error("fashion_mnist_cuda", "a batch of " + std::to_string(count) +
                                                    " samples (at most " +
                                                    std::to_string(max_batch_) + ")");
    }
  }

  std::size_t hidden_;
  Precision precision_;
  tandem::cuda_exec exec_;
  Blas blas_;
  tandem::Parameters<float, device> params_;
  tandem::Parameters<float, device>::Parameter *fc1_w_, *fc1_b_, *fc2_w_, *fc2_b_;
  std::optional<BatchNorm> bn_;
  std::optional<tandem::amp::ComputeWeights<O2MasterGrads<tandem::half>, device>> half_weights_;
  std::optional<tandem::amp::ComputeWeights<O2MasterGrads<tandem::bfloat16>, device>>
      bfloat16_weights_;
  std::optional<tandem::amp::ComputeWeights<tandem::amp::O0, device>> float_weights_;
  tandem::Buffer<float, device> x_c_, h1_, bn_out_, act_c_, logits_, d32_, d_c_, drelu_, dh1_,
      dh1_c_, loss_;
  tandem::Buffer<int, device> hits_;
  std::size_t max_batch_ = 0;
};

constexpr std::size_t eval_batch = 500;

/// Accuracy over the test set (resident on the GPU) split by the evaluation sampler: every
/// sample counted once.
template <class Comm>
double evaluate(Comm& comm, Mlp<Comm>& model, const ResidentData& test,
                const tandem::Buffer<std::int64_t, device>& indices, std::size_t count) {
  model.refresh_weights();
  model.batch_norm().eval();
  model.reset_hits();
  for (std::size_t first = 0; first < count; first += eval_batch) {
    const std::size_t n = std::min(eval_batch, count - first);
    const std::int64_t* index = indices.data() + first;
    model.forward(test.rows(), index, n);
    model.loss(Labels{nullptr, test.labels.data(), index}, n, 1.0f, true);
  }
  const std::int64_t hits = model.hits();
  model.batch_norm().train();
  const auto totals = tandem::reduce_sum(comm, std::array<double, 2>{double(hits), double(count)});
  return totals[0] / totals[1];
}

/// What --min-accuracy checks at the end (the CTest test): a run that did not train fails.
struct RunSummary {
  double accuracy = 0;
  double last_loss = 0;
  double scale = 0;
  std::int64_t steps = 0;
  std::int64_t expected_steps = 0;
  std::int64_t skipped = 0;
};

int check_run(const Settings& settings, const RunSummary& run, double min_accuracy) {
  std::vector<std::string> problems;
  if (!(run.accuracy * 100 >= min_accuracy))
    problems.push_back("test accuracy " + std::to_string(100 * run.accuracy) + " % < " +
                       std::to_string(min_accuracy) + " %");
  if (!std::isfinite(run.last_loss) || run.last_loss <= 0)
    problems.push_back("training loss " + std::to_string(run.last_loss));
  if (run.steps != run.expected_steps)
    problems.push_back(std::to_string(run.steps) + " steps, expected " +
                       std::to_string(run.expected_steps));
  if (settings.precision == "fp16") {
    // GradScaler: 2^16 to start; a few backoffs at most, growth once per 2000 clean steps.
    if (!(run.scale >= 1024.0 && run.scale <= 16777216.0))
      problems.push_back("loss scale " + std::to_string(run.scale) + " outside [2^10, 2^24]");
    if (run.skipped * 20 > run.steps)
      problems.push_back(std::to_string(run.skipped) + " of " + std::to_string(run.steps) +
                         " steps skipped (inf/NaN gradients)");
  } else if (run.skipped != 0 || run.scale != 1.0) {
    problems.push_back("no loss scaling expected for " + settings.precision);
  }
  for (const auto& p : problems)
    std::fprintf(stderr, "fashion_mnist_cuda: CHECK FAILED: %s\n", p.c_str());
  return problems.empty() ? 0 : 1;
}

/// One rank's whole run on the current GPU, every kernel on `stream`.
template <tandem::Communicator Comm>
RunSummary train(Comm& comm, const Settings& settings, std::size_t eval_samples,
                 cudaStream_t stream) {
  // The same run on every rank, or an Error on every rank naming the flag and who has what.
  examples::agree_on_flags(comm, settings,
                           {{"--wide", settings.wide},
                            {"--plain", settings.plain},
                            {"--precision", std::string_view(settings.precision)},
                            {"--resident", settings.resident}});
  const tandem::FashionMNIST train_set(tandem::split::train, settings.data);
  const tandem::FashionMNIST test_set(tandem::split::test, settings.data);
  const tandem::cuda_exec exec{stream};
  const Precision precision = precision_of(settings);
  Mlp<Comm> model(comm, fashion_mnist::hidden_width(settings), settings.seed, precision,
                  std::max(settings.batch_size, eval_batch), stream);
  tandem::DistributedDataParallel<Comm, tandem::overlap> ddp(comm, model.params(), exec);

  const auto groups = fashion_mnist::sgd_groups(settings);
  tandem::optim::SGD<float, device, tandem::cuda_exec> optimizer(model.params(), std::span(groups),
                                                                 exec);
  tandem::GradScaler<device> scaler({.enabled = precision == Precision::fp16});
  tandem::DistributedSampler sampler(train_set.size(), comm,
                                     {.shuffle = true, .seed = settings.seed});
  auto batches = sampler | tandem::views::batches(settings.batch_size);
  const auto steps_per_epoch = static_cast<std::int64_t>(batches.size());
  const std::int64_t total_steps = steps_per_epoch * settings.epochs;
  auto schedule = fashion_mnist::lr_schedule(optimizer, settings, total_steps);
  tandem::EMA<float, device, tandem::cuda_exec> ema(model.params(), fashion_mnist::ema_options(),
                                                    exec);
  tandem::Loader loader(train_set, batches, {.workers = settings.resident ? 0 : settings.workers},
                        tandem::cuda_delivery(stream));
  std::optional<ResidentData> resident;
  if (settings.resident) resident.emplace(train_set, stream);
  const ResidentData test(test_set, stream);
  const auto eval_sampler = tandem::DistributedSampler::evaluation(
      eval_samples > 0 ? std::min(eval_samples, test_set.size()) : test_set.size(), comm);
  const auto eval_indices =
      device_indices(std::vector<std::int64_t>(eval_sampler.begin(), eval_sampler.end()), stream);

  std::int64_t step = 0;
  std::size_t batches_done = 0;
  tandem::TrainingState state;
  state.model(model.params())
      .optimizer(optimizer)
      .ema(ema, model.params())
      .scheduler(schedule)
      .sampler(sampler, batches_done, settings.batch_size)
      .counter("step", step);
  examples::resume_from_latest(comm, settings.resume, settings.checkpoint_dir, state, loader,
                               batches_done, step);
  tandem::TensorBoardWriter board = examples::rank0_board(comm, settings.tensorboard);
  const bool first_attempt = examples::first_attempt();

  RunSummary run;
  run.expected_steps =
      settings.max_steps >= 0 ? std::min(settings.max_steps, total_steps) : total_steps;
  double mean_loss = 0;
  double trained_seconds = 0;  // training only: the evaluations are not counted
  using clock = std::chrono::steady_clock;

  // One training step on `count` samples: rows(index[s]) (or rows(s) without an index).
  auto train_step = [&](auto rows, const std::int64_t* index, Labels labels, std::size_t count) {
    if (settings.crash_at_step == step && comm.rank() == 1 && first_attempt) ::raise(SIGKILL);
    ddp.before_forward();
    optimizer.zero_grad();
    model.refresh_weights();  // the compute copy of this step's master weights (O2)
    model.forward(rows, index, count);
    model.loss(labels, count, scaler.scale(1.0f), false);  // d(scale * loss)
    model.backward(count, [&](auto& param) { ddp.grad_ready(param); });
    ddp.finish_gradient_sync();
    if (!scaler.step(optimizer)) ++run.skipped;  // unscale, inf check, SGD unless inf/NaN
    scaler.update();
    schedule.step();
    if (!settings.plain) ema.update();
    ++batches_done;
    ++step;
    if (step % 50 == 0 || batches_done == batches.size() || step == run.expected_steps) {
      mean_loss = tandem::reduce_mean(comm, model.mean_loss(count));
      board.add_scalar("train/loss", mean_loss, step);
    }
  };

  double accuracy = 0;
  for (auto epoch = static_cast<int>(sampler.epoch()); epoch < settings.epochs; ++epoch) {
    examples::begin_epoch(sampler, epoch, batches_done);
    const auto epoch_start = clock::now();
    tandem::Progress progress =
        examples::epoch_progress(comm, epoch, batches.size() - batches_done);
    auto stop = [&] { return settings.max_steps >= 0 && step >= settings.max_steps; };
    if (resident) {
      // This epoch's order on the GPU once; each step gathers its batch there.
      const auto order =
          device_indices(std::vector<std::int64_t>(sampler.begin(), sampler.end()), stream);
      for (std::size_t b = batches_done; b < batches.size(); ++b) {
        const std::size_t first = b * settings.batch_size;
        const std::size_t count = std::min(settings.batch_size, sampler.size() - first);
        const std::int64_t* index = order.data() + first;
        train_step(resident->rows(), index, Labels{nullptr, resident->labels.data(), index}, count);
        progress.update({{"loss", mean_loss}, {"lr", optimizer.lr(0)}});
        if (stop()) break;
      }
      exec.synchronize();  // `order` is freed here: the steps must be done with it
    } else {
      for (const auto& batch : loader) {
        auto [images, labels] = batch.views();
        train_step(FloatRows{images.data()}, nullptr, Labels{labels.data(), nullptr, nullptr},
                   batch.size());
        progress.update({{"loss", mean_loss}, {"lr", optimizer.lr(0)}});
        if (stop()) break;
      }
    }
    exec.synchronize();  // the epoch's work has run: only now is its time known
    progress.finish();
    trained_seconds += std::chrono::duration<double>(clock::now() - epoch_start).count();
    accuracy = evaluate(comm, model, test, eval_indices, eval_sampler.size());
    double ema_accuracy = accuracy;
    if (!settings.plain) {
      auto applied = ema.applied();
      ema_accuracy = evaluate(comm, model, test, eval_indices, eval_sampler.size());
    }
    examples::end_epoch(comm, board, {epoch, step, accuracy, ema_accuracy, trained_seconds},
                        sampler, batches_done, batches.size());
    if (!settings.checkpoint_dir.empty()) {
      tandem::save_checkpoint(comm, settings.checkpoint_dir, step, state);
    }
    if (stop()) break;
  }
  run.accuracy = accuracy;
  run.last_loss = mean_loss;
  run.scale = scaler.get_scale();
  run.steps = step;
  tandem::log0(comm) << "test accuracy " << 100 * accuracy << " % after " << step << " steps on "
                     << comm.size() << " ranks (" << settings.precision << ", loss scale "
                     << run.scale << ", " << run.skipped << " steps skipped, "
                     << (settings.resident ? "data resident on the GPU" : "Loader to the GPU")
                     << ")";
  return run;
}

/// This thread's GPU for `world`, and a stream on it for everything the rank does.
struct RankDevice {
  explicit RankDevice(const tandem::World& world)
      : index(tandem::cuda::select_device(world)), stream() {}
  int index;
  tandem::cuda::Stream stream;
};

}  // namespace

int main(int argc, char** argv) {
  using fashion_mnist::program;
  // --min-accuracy and --eval-samples are this program's own (the tests'); the rest are the
  // recipe's flags.
  std::optional<double> min_accuracy;
  std::size_t eval_samples = 0;  // 0: the whole test set
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--min-accuracy" && i + 1 < argc) {
      min_accuracy = std::atof(argv[++i]);
    } else if (std::string_view(argv[i]) == "--eval-samples" && i + 1 < argc) {
      eval_samples = static_cast<std::size_t>(std::strtoull(argv[++i], nullptr, 10));
    } else {
      args.push_back(argv[i]);
    }
  }
  const auto settings =
      fashion_mnist::parse(static_cast<int>(args.size()), args.data(), program::gpu);
  if (!settings) return fashion_mnist::usage(program::gpu);
  if (tandem::cuda::device_count() == 0) {
    std::printf(
        "fashion_mnist_cuda: SKIPPED: no CUDA device here (no driver, or no GPU); the program "
        "is built, not run\n");
    return 77;
  }
  const auto timeout = std::chrono::seconds(settings->timeout_seconds);
  try {
    RunSummary run;
    if (settings->backend == "local") {
      tandem::run_local(
          settings->ranks,
          [&](tandem::LocalComm& comm) {
            // Every thread on this process's GPU (local rank 0's): they share it.
            RankDevice gpu(tandem::World{});
            const RunSummary r = train(comm, *settings, eval_samples, gpu.stream.get());
            if (comm.rank() == 0) run = r;
          },
          tandem::LocalCommOptions{timeout});
#if TANDEM_EXAMPLE_WITH_GLOO
    } else if (settings->backend == "gloo") {
      RankDevice gpu(tandem::World::from_env());
      tandem::GlooCommOptions options;
      options.timeout = timeout;
      auto comm = tandem::init_process_group<tandem::GlooComm>("env://", options);
      run = train(comm, *settings, eval_samples, gpu.stream.get());
      comm.barrier();
#endif
#if TANDEM_EXAMPLE_WITH_NCCL
    } else if (settings->backend == "nccl") {
      const auto world = tandem::World::from_env();
      RankDevice gpu(world);
      tandem::NcclCommOptions options;
      options.timeout = timeout;
      options.stream = gpu.stream.get();  // collectives ordered with the training stream
      // Without a launcher (one rank) no rendezvous is needed: a fresh id makes the group.
      auto comm = std::getenv("WORLD_SIZE")
                      ? tandem::init_process_group<tandem::NcclComm>(world, "env://", options)
                      : tandem::NcclComm::create(tandem::NcclComm::unique_id(), 0, 1, options);
      run = train(comm, *settings, eval_samples, gpu.stream.get());
      comm.synchronize();
#endif
    } else {
      std::fprintf(stderr, "fashion_mnist_cuda: backend '%s' is not built in\n",
                   settings->backend.c_str());
      return fashion_mnist::usage(program::gpu);
    }
    if (min_accuracy) return check_run(*settings, run, *min_accuracy);
    return std::isfinite(run.accuracy) ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fashion_mnist_cuda: %s\n", e.what());
    return 1;
  }
}
