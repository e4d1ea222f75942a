// tandem/comm/store.hpp - DEPRECATED: forwards to tandem/rendezvous/store.hpp; include that
// instead. This old path keeps working in tandem 0.1 and 0.2 and goes away in 0.3 (issue 21 moved
// Store, HashStore, PrefixStore, AnyStore to tandem/rendezvous/). No #warning here: it would break
// builds with -Werror.
#pragma once

#include "tandem/rendezvous/store.hpp"
