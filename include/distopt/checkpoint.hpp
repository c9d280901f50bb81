// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Checkpoints: `opt.save(dir)` and `opt.load(dir)` (collective).
///
/// A checkpoint is a directory:
///   index.json                                  written last, atomically (rename)
///   distopt-GEN-tpT-of-TT-rankR-of-D.safetensors  one per rank, written before the index
/// GEN names one save (the step and a random number all ranks agree on), so a new save
/// never overwrites the files the current index names: a crash at any point leaves the
/// previous checkpoint loadable. After the new index is in place, rank 0 removes the older
/// generations' files and any temporary files.
///
/// Each rank file holds this rank's slices of every tensor's params, master weights and
/// states under stable names ("<tensor>/param", "<tensor>/master", "<tensor>/state.K",
/// "<tensor>/state.K.codes" and ".absmax" for q8, "<tensor>/row_states",
/// "<tensor>/col_states", "<tensor>/projected.K", "<tensor>/projector.left|right",
/// "<tensor>/clip_history"). Its "__metadata__" entry "distopt.items" says, per name, which
/// elements [first, first + count) of a flat vector of `total` elements the slice holds,
/// the whole vector's shape, and an xxHash3-64 of each chunk of 2^18 elements (chunks
/// aligned to the vector, so a reader checks exactly the chunks it reads). The index holds
/// the policy, dtypes, layout, step, hyper-parameters and other scalars, the size and
/// header hash of every rank file, and a hash of itself.
///
/// Loading works for any data-parallel size: each rank reads the headers, then only the
/// chunks that hold its own elements. Every rank checks everything it reads; then the
/// ranks agree (one all-reduce) before anyone changes its state, so a bad checkpoint
/// leaves every rank's optimizer as it was. Each TP part writes its own files; the items
/// also say where the part's box lies in the whole (TP-unsplit) array, so a checkpoint
/// loads on another TP size, or another split of a tensor: each rank then reads its box
/// from the parts holding it (the index's "whole_tensors" must match). 8-bit absmax of
/// blocks that a TP cut splits have no such place and load only on the saving TP layout.
///
/// Needs xxHash (Debian: libxxhash-dev), used header-only.
///
/// The parts: io/checkpoint_format.hpp (the index and items texts, the checksums),
/// io/checkpoint_files.hpp (writing and reading the files, for any optimizer through a
/// type-erased party), io/checkpoint_state.hpp (an optimizer's items and scalars, read from
/// its context and stages).

#include "io/checkpoint_files.hpp"
#include "io/checkpoint_format.hpp"
#include "io/checkpoint_state.hpp"
#include "optimizer.hpp"
