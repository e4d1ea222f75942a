// tandem/io/detail/host_values.hpp - collectives over a few host values on any communicator: moved
// to tandem/comm/detail/host_values.hpp (comm/agree.hpp needs them too, and comm/ cannot include
// io/); this path keeps io's includes working.
#pragma once

#include "tandem/comm/detail/host_values.hpp"
