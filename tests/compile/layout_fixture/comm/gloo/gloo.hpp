// A backend that includes another backend: layout_rules_catches expects scripts/check_layout.py
// to name this include.
#pragma once

#include "tandem/comm/shm/shm.hpp"
