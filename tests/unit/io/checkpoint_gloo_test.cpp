// Exact resume on GlooComm: ranks as threads, each with its own GlooComm (real TCP transport).
#include <doctest/doctest.h>

#include "resume_suite.hpp"
#include "support/runners.hpp"
#include "support/temp_dir.hpp"

// One namespace per file: io_checkpoints builds this room's checkpoint tests as one unity
// translation unit (CI time), where the files' anonymous namespaces and using-directives meet.
namespace io_checkpoint_gloo_test {

TEST_CASE("a resumed Gloo run ends bit for bit where an uninterrupted one does") {
  for (bool broadcast : {false, true}) {
    CAPTURE(broadcast);
    tandem::test::TempDir dir;
    CHECK(tandem::test::resume::check_resume(tandem::test::GlooThreadRunner{}, 2, dir.path(),
                                             broadcast) == 2);
  }
}

}  // namespace io_checkpoint_gloo_test
