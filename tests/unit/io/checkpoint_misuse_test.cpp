// Checkpoints misused, and on a shared machine: files honour the umask; a second job using a
// directory is refused naming the first, and loses nothing of it (nor has its in-flight file
// swept); a fresh run never overwrites or prunes checkpoints it did not resume from; a directory
// that cannot be written is found before the first step; a save that fails on rank 0 alone (a
// file size limit, a full tmpfs) is rank 0's Error with its cause and every other rank's Error
// names rank 0 and carries the cause; ranks that would load different checkpoints are refused,
// naming the ranks and what each holds.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "misuse_support.hpp"
#include "support/temp_dir.hpp"
#include "tandem/amp/grad_scaler.hpp"
#include "tandem/arena/parameters.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/data/sampler.hpp"
#include "tandem/io/checkpoint.hpp"
#include "tandem/optim/lr_scheduler.hpp"
#include "tandem/optim/sgd.hpp"

// One namespace per file: io_checkpoints builds this room's checkpoint tests as one unity
// translation unit (CI time), where the files' anonymous namespaces and using-directives meet.
namespace io_checkpoint_misuse_test {

namespace fs = std::filesystem;
using namespace tandem::test::misuse;

namespace {

// A model of `floats` values, all equal to the step, and the step: what the jobs here save.
struct Job {
  tandem::Parameters<float> params;
  std::int64_t step = 0;
  tandem::TrainingState state;
  explicit Job(std::int64_t floats = 64) {
    params.add("w", {floats});
    params.finalize();
    state.model(params).counter("step", step);
  }
  void save(tandem::LocalComm& comm, const fs::path& dir, std::int64_t at,
            const tandem::CheckpointOptions& options = {}) {
    step = at;
    for (auto& v : params.values()) v = static_cast<float>(at);
    tandem::save_checkpoint(comm, dir, at, state, options);
  }
};

std::vector<std::int64_t> steps_in(const fs::path& dir) {
  std::vector<std::int64_t> steps;
  for (const auto& [step, path] : tandem::list_checkpoints(dir)) {
    tandem::SafetensorsFile::map(path).verify_checksum();  // every one whole
    steps.push_back(step);
  }
  return steps;
}

int count_temporaries(const fs::path& dir) {
  int count = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    count += entry.path().filename().string().find(".tmp-") != std::string::npos;
  }
  return count;
}

// A pipe's two ends, to make one process wait for another without sleeping.
struct Signal {
  int fds[2] = {-1, -1};
  Signal() { REQUIRE(::pipe(fds) == 0); }
  void send() const { REQUIRE(::write(fds[1], "x", 1) == 1); }
  bool wait() const {
    char byte = 0;
    return ::read(fds[0], &byte, 1) == 1;
  }
};

}  // namespace

TEST_CASE("checkpoints, the lock file and temporary files are created as the umask says") {
  for (const mode_t mask : {mode_t{022}, mode_t{027}, mode_t{077}, mode_t{002}}) {
    CAPTURE(mask);
    tandem::test::TempDir dir;
    const mode_t before = ::umask(mask);
    errors_of_ranks(2, [&](tandem::LocalComm& comm) { Job().save(comm, dir.path(), 1); });
    tandem::SafetensorsWriter plain;
    plain.add("x", std::vector<float>{1, 2});
    plain.write(dir / "plain.safetensors");
    ::umask(before);
    const mode_t expected = 0666 & ~mask;
    for (const auto& name : {std::string("checkpoint-000000000001.safetensors"),
                             std::string(".checkpoint-lock"), std::string("plain.safetensors")}) {
      CAPTURE(name);
      struct stat info {};
      REQUIRE(::stat((dir / name).c_str(), &info) == 0);
      CHECK((info.st_mode & 0777) == expected);
    }
  }
}

TEST_CASE("a second job using a directory is refused naming the first, and loses it nothing") {
  tandem::test::TempDir dir;
  const fs::path ckpt = dir.path() / "ckpt";
  Signal first_saved, may_go_on;
  fs::path in_flight;
  // Job A, a process of its own: saves steps 1-3, waits while the others try, saves step 4.
  std::fflush(nullptr);
  const pid_t job_a = ::fork();
  REQUIRE(job_a >= 0);
  if (job_a == 0) {
    ::setenv("TORCHELASTIC_RUN_ID", "job-a", 1);
    int code = 0;
    try {
      tandem::run_local(2, [&](tandem::LocalComm& comm) {
        Job job;
        tandem::open_checkpoints(comm, ckpt, job.state);
        for (std::int64_t s = 1; s <= 3; ++s) job.save(comm, ckpt, s);
        if (comm.rank() == 0) {
          first_saved.send();
          may_go_on.wait();
        }
        comm.barrier();
        job.save(comm, ckpt, 4);
      });
    } catch (const std::exception& error) {
      std::fprintf(stderr, "job A: %s\n", error.what());
      code = 1;
    }
    std::_Exit(code);
  }
  REQUIRE(first_saved.wait());
  // A's save of step 4 in flight, as another job would see it: its temporary file.
  in_flight = ckpt / (".checkpoint-000000000004.safetensors.tmp-" + std::to_string(job_a) + "-0");
  write_file(in_flight, "half a checkpoint");

  // Job B, started meanwhile: refused before its first step, naming A; every rank says so.
  ::setenv("TORCHELASTIC_RUN_ID", "job-b", 1);
  for (const bool resume : {false, true}) {
    CAPTURE(resume);
    const auto errors = errors_of_ranks(2, [&](tandem::LocalComm& comm) {
      Job job;
      tandem::open_checkpoints(comm, ckpt, job.state, {.resume = resume});
    });
    CAPTURE(errors[0]);
    CAPTURE(errors[1]);
    CHECK(contains(errors[0], "tandem: rank 0: open_checkpoints " + ckpt.string()));
    CHECK(contains(errors[0], "in use by another job (run job-a"));
    CHECK(contains(errors[0], "pid " + std::to_string(job_a)));
    CHECK(contains(errors[0], "since 20"));
    CHECK(contains(errors[1], "tandem: rank 1: open_checkpoints"));
    CHECK(contains(errors[1], "rank 0 failed to prepare its checkpoint directory"));
    CHECK(contains(errors[1], "in use by another job (run job-a"));
  }
  // Nor can it save there directly.
  const auto save_errors =
      errors_of_ranks(2, [&](tandem::LocalComm& comm) { Job().save(comm, ckpt, 3); });
  CHECK(contains(save_errors[0], "in use by another job (run job-a"));
  CHECK(contains(save_errors[1], "rank 0 failed to save checkpoint step 3"));
  ::unsetenv("TORCHELASTIC_RUN_ID");
  CHECK(fs::exists(in_flight));  // A's file in flight untouched
  CHECK(steps_in(ckpt) == std::vector<std::int64_t>{3, 2, 1});

  may_go_on.send();
  int status = 0;
  REQUIRE(::waitpid(job_a, &status, 0) == job_a);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);  // A went on undisturbed
  CHECK(steps_in(ckpt) == std::vector<std::int64_t>{4, 3, 2});

  // A fresh job (no resume) after A: refused, since saving would overwrite and prune A's
  // checkpoints; A being dead, its claim sweeps A's temporary file.
  const int fresh = in_child([&] {
    const auto errors = errors_of_ranks(2, [&](tandem::LocalComm& comm) {
      Job job;
      tandem::open_checkpoints(comm, ckpt, job.state);
    });
    const bool refused =
        contains(errors[0],
                 "already holds 3 checkpoint(s) (the newest: "
                 "checkpoint-000000000004.safetensors) that this run did not resume "
                 "from") &&
        contains(errors[1], "rank 0 failed to prepare its checkpoint directory");
    if (!refused)
      std::fprintf(stderr, "fresh job: '%s' '%s'\n", errors[0].c_str(), errors[1].c_str());
    return refused ? 0 : 1;
  });
  CHECK(fresh == 0);
  CHECK_FALSE(fs::exists(in_flight));
  CHECK(steps_in(ckpt) == std::vector<std::int64_t>{4, 3, 2});

  // A job that resumes from them continues that run: it may save and prune.
  errors_of_ranks(2, [&](tandem::LocalComm& comm) {
    Job job;
    const auto last = tandem::open_checkpoints(comm, ckpt, job.state, {.resume = true});
    REQUIRE(last.has_value());
    CHECK(job.step == 4);
    job.save(comm, ckpt, 5);
  });
  CHECK(steps_in(ckpt) == std::vector<std::int64_t>{5, 4, 3});
  CHECK(count_temporaries(ckpt) == 0);
}

TEST_CASE("a directory that cannot be written is found before the first step") {
  tandem::test::TempDir dir;
  // Missing: made.
  errors_of_ranks(2, [&](tandem::LocalComm& comm) {
    Job job;
    CHECK_FALSE(tandem::open_checkpoints(comm, dir.path() / "a" / "b", job.state).has_value());
  });
  CHECK(fs::is_directory(dir.path() / "a" / "b"));
  // Under a regular file: cannot be made.
  write_file(dir.path() / "file", "x");
  const auto under_file = dir.path() / "file" / "ckpt";
  auto errors = errors_of_ranks(2, [&](tandem::LocalComm& comm) {
    Job job;
    tandem::open_checkpoints(comm, under_file, job.state);
  });
  CAPTURE(errors[0]);
  CHECK(contains(errors[0], "rank 0: open_checkpoints " + under_file.string()));
  CHECK(contains(errors[0], "cannot create the directory " + under_file.string()));
  CHECK(contains(errors[0], "Not a directory (errno 20)"));
  CHECK(contains(errors[1],
                 "rank 0 failed to prepare its checkpoint directory: checkpoint directory " +
                     under_file.string()));
  CHECK(contains(errors[1], "Not a directory (errno 20)"));

  // Read-only: a read-only tmpfs in a mount namespace of a child's own, or (not as root, whom
  // permissions do not stop) a directory without write permission.
  const auto read_only = dir.path() / "ro";
  const auto report = dir.path() / "ro-errors";
  const int code = in_child([&] {
    if (::geteuid() == 0) {
      if (!private_mounts() || !mount_tmpfs(read_only, "size=64k", MS_RDONLY)) {
        return cannot_set_up;
      }
    } else {
      fs::create_directories(read_only);
      fs::permissions(read_only, fs::perms::owner_read | fs::perms::owner_exec);
    }
    const auto found = errors_of_ranks(2, [&](tandem::LocalComm& comm) {
      Job job;
      tandem::open_checkpoints(comm, read_only, job.state);
    });
    write_file(report, found[0] + "\n" + found[1]);
    return 0;
  });
  if (code == cannot_set_up) {
    MESSAGE("skipped the read-only directory: no mount namespace here");
    return;
  }
  REQUIRE(code == 0);
  const auto text = read_text(report);
  CAPTURE(text);
  CHECK(contains(text, "rank 0: open_checkpoints " + read_only.string()));
  CHECK((contains(text, "Read-only file system (errno 30)") ||
         contains(text, "Permission denied (errno 13)")));
  CHECK(contains(text, "rank 1: open_checkpoints"));
  CHECK(contains(text, "rank 0 failed to prepare its checkpoint directory"));
}

namespace {

// In a child: saves a 1 MB model into `ckpt`, where rank 0's write fails; each rank's Error
// text into `report` (a line each), and what the directory holds after it.
int save_where_rank0_fails(const fs::path& ckpt, const fs::path& report) {
  const auto errors = errors_of_ranks(3, [&](tandem::LocalComm& comm) {
    Job job(256 * 1024);
    tandem::open_checkpoints(comm, ckpt, job.state);
    job.save(comm, ckpt, 200);
  });
  std::string text;
  for (const auto& error : errors) text += error + "\n";
  text += "temporaries " + std::to_string(count_temporaries(ckpt)) + "\n";
  text += "checkpoints " + std::to_string(tandem::list_checkpoints(ckpt).size()) + "\n";
  write_file(report, text);
  return 0;
}

void check_rank0_failure_reported(const std::string& text, const std::string& cause) {
  CAPTURE(text);
  std::vector<std::string> lines;
  for (std::size_t at = 0, end; (end = text.find('\n', at)) != std::string::npos; at = end + 1) {
    lines.push_back(text.substr(at, end - at));
  }
  REQUIRE(lines.size() == 5);
  // Rank 0: its own failure and cause; no word of another rank.
  CHECK(lines[0].starts_with("tandem: rank 0: save_checkpoint step 200 ("));
  CHECK(contains(lines[0], "cannot write: " + cause));
  CHECK_FALSE(contains(lines[0], "failed to save"));
  // The others: whose failure they follow, and its cause.
  for (int r = 1; r <= 2; ++r) {
    CAPTURE(r);
    const auto& line = lines[static_cast<std::size_t>(r)];
    CHECK(line.starts_with("tandem: rank " + std::to_string(r) + ": save_checkpoint step 200 ("));
    CHECK(contains(line, "rank 0 failed to save checkpoint step 200: "));
    CHECK(contains(line, "cannot write: " + cause));
  }
  CHECK(lines[3] == "temporaries 0");  // the failed save removed its temporary file
  CHECK(lines[4] == "checkpoints 0");
}

}  // namespace

TEST_CASE("rank 0 failing alone to save is reported as rank 0's, with its cause, by every rank") {
  tandem::test::TempDir dir;
  SUBCASE("a file size limit (EFBIG)") {
    const auto report = dir.path() / "report";
    const int code = in_child([&] {
      ::signal(SIGXFSZ, SIG_IGN);
      const rlimit limit{64 * 1024, 64 * 1024};
      if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return cannot_set_up;
      return save_where_rank0_fails(dir.path() / "ckpt", report);
    });
    REQUIRE(code == 0);
    check_rank0_failure_reported(read_text(report), "File too large");
  }
  SUBCASE("a full disk (ENOSPC, a 128 KB tmpfs)") {
    const auto report = dir.path() / "report";
    const int code = in_child([&] {
      if (!private_mounts() || !mount_tmpfs(dir.path() / "full", "size=128k")) {
        return cannot_set_up;
      }
      return save_where_rank0_fails(dir.path() / "full" / "ckpt", report);
    });
    if (code == cannot_set_up) {
      MESSAGE("skipped the full disk: no mount namespace here (the file size limit stands in)");
      return;
    }
    REQUIRE(code == 0);
    check_rank0_failure_reported(read_text(report), "No space left on device");
  }
}

TEST_CASE("ranks that would load different checkpoints are refused, naming ranks and values") {
  tandem::test::TempDir dir;
  errors_of_ranks(1, [&](tandem::LocalComm& comm) {
    Job job;
    job.save(comm, dir.path(), 1);
    job.save(comm, dir.path(), 2);
  });
  const auto one = tandem::checkpoint_path(dir.path(), 1);
  const auto two = tandem::checkpoint_path(dir.path(), 2);
  const auto fingerprint = [](const fs::path& path) {
    return tandem::SafetensorsFile::map(path).fingerprint();
  };
  REQUIRE(fingerprint(one) != fingerprint(two));

  SUBCASE("different files") {
    const auto errors = errors_of_ranks(3, [&](tandem::LocalComm& comm) {
      Job job;
      tandem::load_checkpoint(comm, comm.rank() == 1 ? one : two, job.state);
    });
    for (int r = 0; r < 3; ++r) {
      const auto& error = errors[static_cast<std::size_t>(r)];
      CAPTURE(error);
      CHECK(error.starts_with("tandem: rank " + std::to_string(r) + ": load_checkpoint "));
      CHECK(contains(error, "the ranks hold different checkpoints: ranks 0, 2: " + two.string() +
                                " (step 2, content " + fingerprint(two) + "); rank 1: " +
                                one.string() + " (step 1, content " + fingerprint(one) + ")"));
    }
  }
  SUBCASE("the same name, different content (node-local directories)") {
    tandem::test::TempDir other;
    fs::copy_file(one, other.path() / two.filename());
    const auto errors = errors_of_ranks(2, [&](tandem::LocalComm& comm) {
      Job job;
      const fs::path& local = comm.rank() == 0 ? dir.path() : other.path();
      tandem::load_checkpoint(comm, local / two.filename(), job.state);
    });
    for (const auto& error : errors) {
      CAPTURE(error);
      CHECK(contains(error, "the ranks hold different checkpoints: rank 0: " + two.string() +
                                " (step 2, content " + fingerprint(two) + "); rank 1: "));
      CHECK(contains(error, "(step 2, content " + fingerprint(one) + ")"));
    }
  }
  SUBCASE("one rank cannot read it: its cause on that rank, named on the others") {
    const auto missing = dir.path() / "checkpoint-000000000009.safetensors";
    const auto errors = errors_of_ranks(2, [&](tandem::LocalComm& comm) {
      Job job;
      tandem::load_checkpoint(comm, comm.rank() == 1 ? missing : two, job.state);
    });
    CAPTURE(errors[0]);
    CAPTURE(errors[1]);
    CHECK(contains(errors[1], "tandem: rank 1: load_checkpoint " + missing.string()));
    CHECK(contains(errors[1], "cannot open: No such file or directory"));
    CHECK_FALSE(contains(errors[1], "failed to load"));
    CHECK(contains(errors[0], "tandem: rank 0: load_checkpoint " + two.string()));
    CHECK(contains(errors[0], "rank 1 failed to load the checkpoint: safetensors " +
                                  missing.string() + ": cannot open"));
    CHECK(contains(errors[0], "cannot open: No such file or directory"));
  }
  SUBCASE("the newest checkpoint each rank finds") {
    tandem::test::TempDir empty;
    const auto errors = errors_of_ranks(2, [&](tandem::LocalComm& comm) {
      (void)tandem::latest_checkpoint(comm, comm.rank() == 0 ? dir.path() : empty.path());
    });
    for (const auto& error : errors) {
      CAPTURE(error);
      CHECK(contains(error, "the ranks found different newest checkpoints: rank 0: " +
                                two.string() + "; rank 1: none"));
    }
  }
  SUBCASE("agreeing ranks load, and a broadcast load gives every rank rank 0's file") {
    const auto errors = errors_of_ranks(2, [&](tandem::LocalComm& comm) {
      Job job;
      const auto last = tandem::latest_checkpoint(comm, dir.path());
      REQUIRE(last == two);
      tandem::load_checkpoint(comm, *last, job.state);
      CHECK(job.step == 2);
      job.step = 0;
      tandem::load_checkpoint(comm, comm.rank() == 0 ? one : fs::path("/nonexistent"), job.state,
                              {.broadcast = true});
      CHECK(job.step == 1);
    });
    CAPTURE(errors[0]);
    CAPTURE(errors[1]);
    CHECK(errors == std::vector<std::string>{"", ""});
  }
}

TEST_CASE("checkpoint values that do not fit what they restore are refused, naming the field") {
  tandem::test::TempDir dir;
  errors_of_ranks(1, [&](tandem::LocalComm& comm) { Job(12).save(comm, dir.path(), 1); });
  const auto saved = tandem::checkpoint_path(dir.path(), 1);
  // The same data under another shape: a transposed weight has the right element count.
  tandem::Parameters<float> transposed;
  transposed.add("w", {3, 4});
  transposed.finalize();
  std::int64_t step = 0;
  tandem::TrainingState state;
  state.model(transposed).counter("step", step);
  const auto errors = errors_of_ranks(
      1, [&](tandem::LocalComm& comm) { tandem::load_checkpoint(comm, saved, state); });
  CHECK(contains(errors[0], "tensor 'w' has the shape [12] in the file and [3, 4] in the model"));
}

namespace {

// A checkpoint of the parts `Restored` registers, with `state` as its training state; each
// rank's Error text when loaded.
struct Restored {
  tandem::Parameters<float> params;
  std::optional<tandem::optim::SGD<float>> opt;
  tandem::GradScaler<> scaler;
  tandem::DistributedSampler sampler{45, 1, 0, {.seed = 7}};
  std::size_t batches_done = 0;
  std::minstd_rand generator{100};
  std::optional<decltype(tandem::lr::lambda(std::declval<tandem::optim::SGD<float>&>(),
                                            [](std::int64_t) { return 1.0; }))>
      schedule;
  tandem::TrainingState state;
  Restored() {
    params.add("w", {4});
    params.finalize();
    const std::vector<tandem::optim::ParamGroup<tandem::optim::SGDOptions>> groups{
        {tandem::optim::param_range(0, 1), {.lr = 0.1, .momentum = 0.9}}};
    opt.emplace(params, std::span(groups));
    schedule.emplace(tandem::lr::lambda(*opt, [](std::int64_t) { return 1.0; }));
    state.optimizer(*opt)
        .scaler(scaler)
        .scheduler(*schedule)
        .sampler(sampler, batches_done)
        .rng("noise", generator);
  }
};

std::string load_error(const nlohmann::json& meta) {
  tandem::SafetensorsWriter writer;
  writer.metadata(tandem::TrainingState::metadata_key, meta.dump());
  const auto bytes = writer.serialize();
  Restored restored;
  try {
    restored.state.load_from(
        tandem::SafetensorsFile::parse(bytes, "made.safetensors"),
        {0, 1, [](const std::string& mine) { return std::vector<std::string>{mine}; }});
  } catch (const tandem::Error& error) {
    return error.what();
  }
  return "";
}

}  // namespace

TEST_CASE("training state values out of range are refused, naming the field") {
  nlohmann::json good;
  {
    Restored restored;
    tandem::SafetensorsWriter writer;
    restored.state.save_to(
        writer, {0, 1, [](const std::string& mine) { return std::vector<std::string>{mine}; }});
    const auto bytes = writer.serialize();
    good = nlohmann::json::parse(tandem::SafetensorsFile::parse(bytes, "x")
                                     .metadata()
                                     .at(tandem::TrainingState::metadata_key));
  }
  REQUIRE(load_error(good).empty());
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> cases{
      {[](nlohmann::json& m) { m["grad_scaler"]["scale"] = 0.0; },
       "'grad_scaler.scale' is 0.0; it must be "
       "positive"},
      {[](nlohmann::json& m) { m["grad_scaler"]["growth_interval"] = 1e20; },
       "'grad_scaler.growth_interval' is 1e+20; it must be a whole number of at least 1"},
      {[](nlohmann::json& m) { m["grad_scaler"]["_growth_tracker"] = -1.5; },
       "'grad_scaler._growth_tracker'"},
      {[](nlohmann::json& m) { m["grad_scaler"]["backoff_factor"] = 1.0; },
       "'grad_scaler.backoff_factor'"},
      {[](nlohmann::json& m) { m["grad_scaler"]["scale"] = true; },
       "'grad_scaler.scale' is true, not a finite number"},
      {[](nlohmann::json& m) { m["optimizer"]["param_groups"][0]["options"]["lr"] = "0.1"; },
       "'optimizer.param_groups.options.lr' is \"0.1\", not a finite number"},
      {[](nlohmann::json& m) { m["lr_scheduler"]["last_epoch"] = -7; }, "has last_epoch -7"},
      {[](nlohmann::json& m) { m["lr_scheduler"]["base_lrs"] = {nullptr}; },
       "'lr_scheduler.base_lrs' is null"},
      {[](nlohmann::json& m) { m["sampler"]["batches_done"] = 46; },
       "'sampler.batches_done' is 46, more batches than the epoch's 45 samples on this rank"},
      {[](nlohmann::json& m) { m["sampler"]["shuffle"] = false; },
       "the sampler was saved with shuffle off and drop_last off; this one has them on and off"},
      {[](nlohmann::json& m) { m["noise"][0] = m["noise"][0].get<std::string>() + " 5"; },
       "'noise' of rank 0 is not a generator's state"},
  };
  for (const auto& [change, expected] : cases) {
    auto meta = good;
    change(meta);
    CAPTURE(meta.dump());
    const auto error = load_error(meta);
    CAPTURE(error);
    CHECK(contains(error, expected));
  }
}

}  // namespace io_checkpoint_misuse_test
