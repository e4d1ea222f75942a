// bench/peers/oneccl_allreduce - one rank of Intel oneCCL's all_reduce (sum, float32, in place),
// timed exactly as bench/allreduce_rank.cpp times tandem, so bench/run_allreduce.sh can put it in
// the same table.
//   tandemrun --standalone --nproc-per-node 2 oneccl_allreduce --store-dir DIR [--sizes B,..]
//     [--runs N] [--iters N] [--warmup N] [--label NAME]
//   CCL_ATL_TRANSPORT=mpi mpiexec -n 2 oneccl_allreduce ...   (Intel MPI's launcher, impi-rt)
// Needs: oneCCL's C++ library and headers (PyPI: oneccl-cpu, oneccl-cpu-devel; run_allreduce.sh
// installs them into a venv and builds this file with g++ by hand, never through CMake, so no
// build of tandem depends on oneCCL). Ranks come from RANK / WORLD_SIZE (tandemrun, torchrun) or
// PMI_RANK / PMI_SIZE (mpiexec); rank 0's key-value-store address reaches the others through a
// file in --store-dir.
//
// Method (as allreduce_rank): per size a correctness check first (ranks hold rank + 1, the sum
// must arrive everywhere, else exit 1), 5 warm-up iterations, then `runs` runs of `iters`
// iterations; an iteration is ccl::barrier, then steady_clock around one ccl::allreduce(...).wait()
// on every rank. An iteration's time is the maximum over the ranks (a ccl::allreduce with max),
// a run's time the median of its iterations. Rank 0 prints per size:
//   RESULT <label> <bytes> <ranks> <median_us> <spread> <fastest_run_us> <slowest_run_us>
//   RUNS <label> <bytes> <run_median_us>...
// The store directory must be fresh per run (an old address file would mislead rank 1).
#include <oneapi/ccl.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

struct Settings {
  std::vector<std::size_t> sizes{std::size_t{4} << 10, std::size_t{256} << 10, std::size_t{4} << 20,
                                 std::size_t{64} << 20};
  int runs = 5;
  int iters = 21;
  int warmup = 5;
  std::string store_dir = "/tmp";
  std::string label = "oneccl";  // the implementation's name in the RESULT lines
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : (values[mid - 1] + values[mid]) / 2.0;
}

/// The first of the variables that is set (tandemrun's, then an MPI launcher's); exits if none.
int env_int(const char* name, const char* mpi_name) {
  for (const char* n : {name, mpi_name}) {
    if (const char* text = std::getenv(n); text != nullptr && *text != '\0') return std::atoi(text);
  }
  std::fprintf(stderr,
               "oneccl_allreduce: neither %s nor %s is set (start the ranks with "
               "tandemrun or mpiexec)\n",
               name, mpi_name);
  std::exit(2);
}

/// Rank 0 creates the main key-value store and writes its address to a file (written under a
/// temporary name, then renamed, so a reader never sees half of it); the others wait for the
/// file. The name carries the launcher's run id and port, so runs never meet an old address.
ccl::shared_ptr_class<ccl::kvs> meet(int rank, const std::string& store_dir) {
  const char* run_id = std::getenv("TORCHELASTIC_RUN_ID");
  const char* port = std::getenv("MASTER_PORT");
  const std::string path =
      store_dir + "/oneccl-kvs-" + (run_id ? run_id : "none") + "-" + (port ? port : "0");
  ccl::kvs::address_type address{};
  if (rank == 0) {
    auto kvs = ccl::create_main_kvs();
    address = kvs->get_address();
    {
      std::ofstream out(path + ".tmp", std::ios::binary);
      out.write(address.data(), static_cast<std::streamsize>(address.size()));
    }
    std::rename((path + ".tmp").c_str(), path.c_str());
    return kvs;
  }
  const auto deadline = clock_type::now() + std::chrono::seconds(120);
  for (;;) {
    std::ifstream in(path, std::ios::binary);
    if (in && in.read(address.data(), static_cast<std::streamsize>(address.size()))) break;
    if (clock_type::now() > deadline) {
      std::fprintf(stderr, "rank %d: no oneCCL address from rank 0 in %s after 120 s\n", rank,
                   path.c_str());
      std::exit(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return ccl::create_kvs(address);
}

void all_reduce(float* data, std::size_t count, const ccl::communicator& comm) {
  ccl::allreduce(data, data, count, ccl::reduction::sum, comm).wait();
}

/// Ranks hold rank + 1: every element must come back as 1 + 2 + ... + size.
void check(std::vector<float>& data, int rank, int size, const ccl::communicator& comm) {
  std::fill(data.begin(), data.end(), static_cast<float>(rank + 1));
  ccl::barrier(comm);
  all_reduce(data.data(), data.size(), comm);
  const float expected = static_cast<float>(size * (size + 1) / 2);
  for (std::size_t i = 0; i < data.size(); ++i) {
    if (data[i] != expected) {
      std::fprintf(stderr, "rank %d: oneccl: element %zu of %zu is %g, expected %g\n", rank, i,
                   data.size(), static_cast<double>(data[i]), static_cast<double>(expected));
      std::exit(1);
    }
  }
}

void measure(const Settings& settings, int rank, int size, const ccl::communicator& comm) {
  for (const std::size_t bytes : settings.sizes) {
    const std::size_t count = bytes / sizeof(float);
    std::vector<float> data(count);
    check(data, rank, size, comm);
    std::fill(data.begin(), data.end(), 0.0f);
    for (int i = 0; i < settings.warmup; ++i) {
      ccl::barrier(comm);
      all_reduce(data.data(), count, comm);
    }
    std::vector<double> run_medians;
    std::vector<double> samples(static_cast<std::size_t>(settings.iters));
    for (int run = 0; run < settings.runs; ++run) {
      for (auto& sample : samples) {
        ccl::barrier(comm);
        const auto start = clock_type::now();
        all_reduce(data.data(), count, comm);
        sample = std::chrono::duration<double, std::micro>(clock_type::now() - start).count();
      }
      ccl::allreduce(samples.data(), samples.data(), samples.size(), ccl::reduction::max, comm)
          .wait();
      run_medians.push_back(median(samples));
    }
    if (rank != 0) continue;
    const auto [fastest, slowest] = std::minmax_element(run_medians.begin(), run_medians.end());
    std::printf("RESULT %s %zu %d %.3f %.4f %.3f %.3f\n", settings.label.c_str(), bytes, size,
                median(run_medians), *slowest / *fastest, *fastest, *slowest);
    std::printf("RUNS %s %zu", settings.label.c_str(), bytes);
    for (const double r : run_medians) std::printf(" %.3f", r);
    std::printf("\n");
    std::fflush(stdout);
  }
}

int usage(const char* program) {
  std::fprintf(
      stderr,
      "usage: %s [--store-dir DIR] [--label NAME] [--sizes BYTES,...] [--runs N] [--iters N] "
      "[--warmup N]\n",
      program);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  for (int i = 1; i < argc; i += 2) {
    const std::string_view flag = argv[i];
    if (i + 1 >= argc) return usage(argv[0]);
    const std::string value = argv[i + 1];
    if (flag == "--store-dir") {
      settings.store_dir = value;
    } else if (flag == "--label") {
      settings.label = value;
    } else if (flag == "--sizes") {
      settings.sizes.clear();
      std::string_view rest = value;
      while (!rest.empty()) {
        const auto comma = rest.find(',');
        settings.sizes.push_back(std::stoull(std::string(rest.substr(0, comma))));
        if (comma == std::string_view::npos) break;
        rest.remove_prefix(comma + 1);
      }
    } else if (flag == "--runs") {
      settings.runs = std::stoi(value);
    } else if (flag == "--iters") {
      settings.iters = std::stoi(value);
    } else if (flag == "--warmup") {
      settings.warmup = std::stoi(value);
    } else {
      return usage(argv[0]);
    }
  }
  if (settings.runs < 1 || settings.iters < 1 || settings.warmup < 0) return usage(argv[0]);
  const int rank = env_int("RANK", "PMI_RANK");
  const int size = env_int("WORLD_SIZE", "PMI_SIZE");
  // oneCCL reads the ranks of this host from its own variables (as torch-ccl sets them); without
  // them it asks its transport and warns.
  if (const char* local = std::getenv("LOCAL_RANK")) setenv("CCL_LOCAL_RANK", local, 0);
  if (const char* local = std::getenv("LOCAL_WORLD_SIZE")) setenv("CCL_LOCAL_SIZE", local, 0);
  try {
    ccl::init();
    auto kvs = meet(rank, settings.store_dir);
    auto comm = ccl::create_communicator(size, rank, kvs);
    if (comm.rank() != rank || comm.size() != size) {
      std::fprintf(stderr, "rank %d: oneCCL made rank %d of %d, expected %d of %d\n", rank,
                   comm.rank(), comm.size(), rank, size);
      return 1;
    }
    measure(settings, rank, size, comm);
    ccl::barrier(comm);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: oneccl_allreduce: %s\n", rank, e.what());
    return 1;
  }
  return 0;
}
