// Writes a few scalars with tandem::TensorBoardWriter into argv[1], for tensorboard_read.py.
#include <cstdio>

#include "tandem/io/tensorboard.hpp"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  tandem::TensorBoardWriter writer(argv[1]);
  for (int step = 0; step < 10; ++step) writer.add_scalar("train/loss", 2.0 / (step + 1), step);
  writer.add_scalar("test/accuracy", 0.8125, 9);
  return 0;
}
