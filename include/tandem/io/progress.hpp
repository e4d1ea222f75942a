// tandem/io/progress.hpp - tandem::Progress, a rank-0 progress display for long loops: step/total,
// rate, ETA and the latest metrics on one line that redraws in place on a terminal, and plain
// lines at an interval when the output is a file or a pipe (logs stay readable).
//   tandem::Progress progress(loader.size(), {.label = "epoch 3", .enabled = comm.rank() == 0});
//   for (const auto& batch : loader) { ...; progress.update({{"loss", loss}, {"lr", lr}}); }
//   progress.finish();
// Needs: the standard library and POSIX (isatty).
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tandem {

/// How a Progress shows itself.
struct ProgressOptions {
  std::string label{};                        ///< printed first ("epoch 3", "eval")
  bool enabled = true;                        ///< false on the ranks that should stay quiet
  std::FILE* stream = stdout;                 ///< where lines go
  std::chrono::milliseconds redraw{100};      ///< on a terminal: the fastest redraw
  std::chrono::milliseconds interval{10000};  ///< elsewhere: a plain line this often
  int terminal = -1;  ///< 1: redraw in place, 0: plain lines, -1: ask isatty(stream)
};

/// Counts steps of a loop of `total` steps and shows the count, the rate, the time left and the
/// latest metrics (name, value pairs).
class Progress {
 public:
  using clock = std::chrono::steady_clock;  ///< what rates and times are measured with

  /// A display for a loop of `total` steps; nothing is shown before the first update.
  explicit Progress(std::size_t total, ProgressOptions options = {})
      : total_(total), options_(std::move(options)), start_(clock::now()), shown_(start_) {
    terminal_ =
        options_.terminal >= 0 ? options_.terminal == 1 : ::isatty(::fileno(options_.stream)) == 1;
  }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  ~Progress() {
    if (!finished_ && options_.enabled && terminal_ && drawn_) std::fputc('\n', options_.stream);
  }

  /// One more step done, with the latest metrics.
  void update(std::initializer_list<std::pair<std::string_view, double>> metrics = {}) {
    advance(1, std::vector<std::pair<std::string_view, double>>(metrics));
  }
  /// `steps` more done, with the latest metrics.
  void advance(std::size_t steps, const std::vector<std::pair<std::string_view, double>>& metrics) {
    done_ += steps;
    metrics_.clear();
    for (const auto& [name, value] : metrics) metrics_.emplace_back(std::string(name), value);
    if (!options_.enabled) return;
    const auto now = clock::now();
    const auto wait = terminal_ ? options_.redraw : options_.interval;
    if (now - shown_ < wait && done_ < total_) return;
    show(now);
  }
  /// The final line: the whole count, the mean rate and the total time.
  void finish() {
    if (finished_) return;
    finished_ = true;
    if (!options_.enabled) return;
    if (drawn_ && shown_done_ == done_) {  // the last line shown is already the final one
      if (terminal_) std::fputc('\n', options_.stream);
      std::fflush(options_.stream);
      return;
    }
    show(clock::now(), true);
  }

  /// Steps done so far.
  [[nodiscard]] std::size_t done() const noexcept { return done_; }
  /// The line as it would be shown now (without the terminal's redraw codes).
  [[nodiscard]] std::string line() const { return compose(clock::now()); }

 private:
  static std::string duration_text(double seconds) {
    if (!(seconds >= 0) || seconds > 359999) return "--:--";
    const auto s = static_cast<long>(seconds + 0.5);
    char text[32];
    if (s >= 3600)
      std::snprintf(text, sizeof text, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
    else
      std::snprintf(text, sizeof text, "%02ld:%02ld", s / 60, s % 60);
    return text;
  }

  std::string compose(clock::time_point now) const {
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double rate = elapsed > 0 ? static_cast<double>(done_) / elapsed : 0;
    std::string text = options_.label.empty() ? "" : options_.label + " ";
    text += std::to_string(done_) + "/" + std::to_string(total_);
    char numbers[96];
    const double left = rate > 0 && total_ > done_ ? static_cast<double>(total_ - done_) / rate : 0;
    std::snprintf(numbers, sizeof numbers, " [%.1f it/s, %s, ETA %s]", rate,
                  duration_text(elapsed).c_str(), duration_text(left).c_str());
    text += numbers;
    for (const auto& [name, value] : metrics_) {
      char metric[64];
      std::snprintf(metric, sizeof metric, " %s %.4g", name.c_str(), value);
      text += metric;
    }
    return text;
  }

  void show(clock::time_point now, bool last = false) {
    const std::string text = compose(now);
    if (terminal_) {
      // Return to the line's start, write it, clear what a longer earlier line left.
      std::fprintf(options_.stream, "\r%s\x1b[K%s", text.c_str(), last ? "\n" : "");
    } else {
      std::fprintf(options_.stream, "%s\n", text.c_str());
    }
    std::fflush(options_.stream);
    shown_ = now;
    shown_done_ = done_;
    drawn_ = true;
  }

  std::size_t total_;
  ProgressOptions options_;
  clock::time_point start_;
  clock::time_point shown_;
  std::size_t done_ = 0;
  std::size_t shown_done_ = 0;
  std::vector<std::pair<std::string, double>> metrics_;
  bool terminal_ = false;
  bool drawn_ = false;
  bool finished_ = false;
};

}  // namespace tandem
