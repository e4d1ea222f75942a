// What layout_fixture/comm/gloo/gloo.hpp includes against the rule.
#pragma once
