// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The one Boost.Test entry point every test executable links.
#define BOOST_TEST_MODULE distopt
#include <boost/test/unit_test.hpp>
