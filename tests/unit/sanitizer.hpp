// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// DISTOPT_TEST_SANITIZED: 1 in a sanitizer build (CI's ASan/UBSan and TSan stages), else 0.
// Their checks are of memory accesses and data races, which a sample of an exhaustive sweep,
// or a few steps of a long run, exercise as well as the whole: the cases that take long cut
// themselves there, and the release build runs them whole. GCC defines __SANITIZE_ADDRESS__
// and __SANITIZE_THREAD__; Clang 16 defines neither and answers through __has_feature.
#pragma once

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define DISTOPT_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define DISTOPT_TEST_SANITIZED 1
#endif
#endif
#ifndef DISTOPT_TEST_SANITIZED
#define DISTOPT_TEST_SANITIZED 0
#endif
