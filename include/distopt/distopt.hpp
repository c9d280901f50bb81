// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Everything a user needs: the optimizer, the policies, storage, communicator and executor.

#include "comm/any.hpp"
#include "comm/single.hpp"
#include "comm/threads.hpp"
#include "concepts.hpp"
#include "config.hpp"
#include "exec/cpu.hpp"
#if defined(__linux__)
#include "exec/emulated.hpp"
#endif
#include "exec/transfer.hpp"
#include "layout/registry.hpp"
#include "loss_scaler.hpp"
#include "memory_report.hpp"
#include "offload.hpp"
#include "optimizer.hpp"
#include "policy/adam.hpp"
#include "policy/adamw.hpp"
#include "policy/hyper_text.hpp"
#include "policy/adafactor.hpp"
#include "policy/came.hpp"
#include "policy/lamb.hpp"
#include "policy/lion.hpp"
#include "policy/sgd.hpp"
#include "space.hpp"
#include "step_info.hpp"
#include "storage/owned.hpp"
#include "storage/q8.hpp"
#include "storage/replicated.hpp"
#include "storage/sharded.hpp"
#include "types/bf16.hpp"
#include "types/dtype.hpp"
#include "types/fp16.hpp"
#include "types/rounding.hpp"
#include "version.hpp"
