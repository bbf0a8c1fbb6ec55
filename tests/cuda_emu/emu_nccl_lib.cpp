// The emulated GPU's NCCL (build/emu/libnccl-emu.so, which the emulated build's NCCL link opens
// in place of libnccl.so.2): the functions lib/comm/nccl_api.cu loads, over MPI between the
// processes, on the emulated device memory (host memory). Every call completes before it returns
// (every stream is in order and immediate on the emulated GPU). A communicator is an MPI
// communicator of its members in NCCL rank order, made by MPI_Comm_create_group (collective over
// the members only, as ncclCommInitRank is): the members send their world ranks to the id's
// creator, which answers with the list.
//
// Two ways real NCCL blocks the host, modelled so that code which would hang on it hangs here:
// a point-to-point connection is made at the first message of each direction between two ranks,
// and the host call waits there until the other rank makes its own (inside a group, the group's
// connections are made together at its end); ncclCommDestroy waits for the communicator's other
// members to destroy it too.
//
// Knobs for the tests: TRELLIS_EMU_NCCL_VERSION (what ncclGetVersion says, NCCL_VERSION_CODE's
// spelling; this header's version by default); TRELLIS_EMU_NCCL_ASYNC_ERROR=N: from the N-th
// call of ncclCommGetAsyncError since it was set on, it reports ncclRemoteError (a peer gone),
// as real NCCL does while its kernels wait for a rank that died.
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

struct ncclComm {
  MPI_Comm comm;
  int rank, size;
  std::set<std::pair<int, int>> connected;  // (sender, receiver): directions connected so far
};

namespace {

constexpr uint32_t kMagic = 0x454d5543u;  // "EMUC"
constexpr int kTagBase = 27000;           // tags on MPI_COMM_WORLD for making communicators

struct Id {
  uint32_t magic;
  int creator;  // world rank
  int serial;   // the creator's how-manieth id
};
static_assert(sizeof(Id) <= sizeof(ncclUniqueId));

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

uint16_t to_bf16(float f) {  // nearest even; NaN stays NaN
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return uint16_t((b >> 16) | 0x40u);
  return uint16_t((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t b = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  auto *a = static_cast<uint16_t*>(in), *b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = to_bf16(from_bf16(a[i]) + from_bf16(b[i]));
}
void bf16_max(void* in, void* inout, int* len, MPI_Datatype*) {
  auto *a = static_cast<uint16_t*>(in), *b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i)
    if (from_bf16(a[i]) > from_bf16(b[i])) b[i] = a[i];
}

bool mpi_type(ncclDataType_t t, MPI_Datatype* m, size_t* bytes) {
  switch (t) {
    case ncclFloat32:
      *m = MPI_FLOAT, *bytes = 4;
      return true;
    case ncclBfloat16:
      *m = MPI_UINT16_T, *bytes = 2;
      return true;
    case ncclInt8:
      *m = MPI_SIGNED_CHAR, *bytes = 1;
      return true;
    case ncclUint8:
      *m = MPI_UNSIGNED_CHAR, *bytes = 1;
      return true;
    case ncclInt32:
      *m = MPI_INT32_T, *bytes = 4;
      return true;
    case ncclFloat64:
      *m = MPI_DOUBLE, *bytes = 8;
      return true;
    default:
      return false;
  }
}
bool mpi_op(ncclRedOp_t op, ncclDataType_t t, MPI_Op* m) {
  static MPI_Op sum16 = MPI_OP_NULL, max16 = MPI_OP_NULL;
  if (t == ncclBfloat16) {
    if (sum16 == MPI_OP_NULL) {
      MPI_Op_create(bf16_sum, 1, &sum16);
      MPI_Op_create(bf16_max, 1, &max16);
    }
    if (op == ncclSum) return *m = sum16, true;
    if (op == ncclMax) return *m = max16, true;
    return false;
  }
  if (op == ncclSum) return *m = MPI_SUM, true;
  if (op == ncclMax) return *m = MPI_MAX, true;
  return false;
}

// Point-to-point operations: posted (MPI_Isend/Irecv) when called, or at ncclGroupEnd inside a
// group, and complete in stream order: the emulated runtime asks (trellis_emu_register_nccl)
// before anything on that stream that comes after them — a kernel, a copy, a free, an event, a
// synchronisation. So a receive posted before a send, as NCCL's streams allow, does not block.
struct Pending {
  bool send;
  void* buf;
  int count;
  MPI_Datatype type;
  int peer;
  MPI_Comm comm;
  cudaStream_t stream;
};
int group_depth = 0;
int live_communicators = 0;  // made and not yet destroyed
std::map<std::string, long> collective_calls;  // by function name (tests: which one ran)
std::vector<Pending> grouped;
struct InFlight {
  MPI_Request request;
  cudaStream_t stream;
  uint64_t serial;
};
std::vector<InFlight> in_flight;
uint64_t next_serial = 1;

constexpr int kConnectTag = 29000;  // on a communicator: a connection's handshake, by sender
// The handshakes of the directions `ops` use that are not yet connected: one byte each way with
// the peer, all posted, then all awaited (the host waits for the other rank to get there too).
ncclResult_t connect(const std::vector<Pending>& ops, const std::vector<ncclComm_t>& comms) {
  std::vector<MPI_Request> reqs;
  std::vector<char> bytes(2 * ops.size(), 0);
  for (size_t i = 0; i < ops.size(); ++i) {
    const Pending& p = ops[i];
    ncclComm_t c = comms[i];
    const int sender = p.send ? c->rank : p.peer, receiver = p.send ? p.peer : c->rank;
    if (!c->connected.insert({sender, receiver}).second) continue;
    reqs.resize(reqs.size() + 2);
    MPI_Isend(&bytes[2 * i], 1, MPI_BYTE, p.peer, kConnectTag + sender, c->comm, &reqs.end()[-2]);
    MPI_Irecv(&bytes[2 * i + 1], 1, MPI_BYTE, p.peer, kConnectTag + sender, c->comm, &reqs.back());
  }
  return MPI_Waitall(int(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE) == MPI_SUCCESS
             ? ncclSuccess
             : ncclSystemError;
}
std::vector<ncclComm_t> grouped_comms;  // grouped[i]'s communicator

void start(const Pending& p) {
  InFlight f{MPI_REQUEST_NULL, p.stream, next_serial++};
  if (p.send)
    MPI_Isend(p.buf, p.count, p.type, p.peer, 0, p.comm, &f.request);
  else
    MPI_Irecv(p.buf, p.count, p.type, p.peer, 0, p.comm, &f.request);
  in_flight.push_back(f);
}

ncclResult_t post(const Pending& p, ncclComm_t comm) {
  if (group_depth > 0) {
    grouped.push_back(p);
    grouped_comms.push_back(comm);
    return ncclSuccess;
  }
  const ncclResult_t r = connect({p}, {comm});
  if (r == ncclSuccess) start(p);
  return r;
}

// Completes (wait) or tests (!wait) the operations on `stream` (null: every stream) started
// before serial `upto` (0: all); true when none of them is left.
bool complete(cudaStream_t stream, uint64_t upto, bool wait) {
  bool all = true;
  for (auto it = in_flight.begin(); it != in_flight.end();) {
    if ((stream && it->stream != stream) || (upto && it->serial >= upto)) {
      ++it;
      continue;
    }
    int done = 0;
    if (wait) {
      MPI_Wait(&it->request, MPI_STATUS_IGNORE);
      done = 1;
    } else {
      MPI_Test(&it->request, &done, MPI_STATUS_IGNORE);
    }
    if (done) {
      it = in_flight.erase(it);
    } else {
      all = false;
      ++it;
    }
  }
  return all;
}
uint64_t mark() { return next_serial; }

bool fits_int(size_t n) { return n <= size_t(INT32_MAX); }

// The communicators ncclCommInitRank asked for (several at once within a group, as NCCL allows:
// each waits for its other members, so none may block before all are under way).
struct Init {
  ncclComm_t* out;
  int nranks, rank;
  Id id;
};
std::vector<Init> inits;

ncclResult_t make_communicators() {
  const int me = world_rank();
  const size_t n = inits.size();
  // Who is who: each member sends (NCCL rank, world rank) to the id's creator, which answers
  // every member with the world ranks in NCCL rank order. Everything that does not depend on an
  // answer is posted before anything waits, so no order of the inits between ranks can deadlock.
  std::vector<std::vector<int>> members(n);
  std::vector<std::vector<int>> heard(n);  // the creator's: (rank, world) pairs
  std::vector<std::array<int, 2>> mine(n);
  std::vector<MPI_Request> asked, answered;
  for (size_t i = 0; i < n; ++i) {
    const Init& in = inits[i];
    const int tag = kTagBase + in.id.serial % 1000;
    members[i].assign(size_t(in.nranks), -1);
    mine[i] = {in.rank, me};
    if (in.id.creator == me) {
      heard[i].resize(2 * size_t(in.nranks - 1));
      for (int k = 0; k + 1 < in.nranks; ++k) {
        asked.emplace_back();
        MPI_Irecv(&heard[i][2 * size_t(k)], 2, MPI_INT, MPI_ANY_SOURCE, tag, MPI_COMM_WORLD,
                  &asked.back());
      }
    } else {
      asked.emplace_back();
      MPI_Isend(mine[i].data(), 2, MPI_INT, in.id.creator, tag, MPI_COMM_WORLD, &asked.back());
      answered.emplace_back();
      MPI_Irecv(members[i].data(), in.nranks, MPI_INT, in.id.creator, tag + 1000, MPI_COMM_WORLD,
                &answered.back());
    }
  }
  if (MPI_Waitall(int(asked.size()), asked.data(), MPI_STATUSES_IGNORE) != MPI_SUCCESS)
    return ncclSystemError;
  for (size_t i = 0; i < n; ++i) {  // the creators answer
    const Init& in = inits[i];
    if (in.id.creator != me) continue;
    members[i][size_t(in.rank)] = me;
    for (int k = 0; k + 1 < in.nranks; ++k) {
      const int r = heard[i][2 * size_t(k)], w = heard[i][2 * size_t(k) + 1];
      if (r < 0 || r >= in.nranks || members[i][size_t(r)] != -1) return ncclInvalidUsage;
      members[i][size_t(r)] = w;
    }
    for (int w : members[i])
      if (w != me) {
        answered.emplace_back();
        MPI_Isend(members[i].data(), in.nranks, MPI_INT, w, kTagBase + 1000 + in.id.serial % 1000,
                  MPI_COMM_WORLD, &answered.back());
      }
  }
  if (MPI_Waitall(int(answered.size()), answered.data(), MPI_STATUSES_IGNORE) != MPI_SUCCESS)
    return ncclSystemError;
  // The MPI communicators, each collective over its members only: made in one order on every
  // rank (by creator, then serial), so that no two ranks wait for each other in a cycle.
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::pair(inits[a].id.creator, inits[a].id.serial) <
           std::pair(inits[b].id.creator, inits[b].id.serial);
  });
  ncclResult_t result = ncclSuccess;
  MPI_Group world;
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  for (size_t i : order) {
    const Init& in = inits[i];
    MPI_Group group;
    MPI_Group_incl(world, in.nranks, members[i].data(), &group);
    auto* c = new ncclComm{MPI_COMM_NULL, in.rank, in.nranks, {}};
    if (MPI_Comm_create_group(MPI_COMM_WORLD, group, kTagBase + 2000 + in.id.serial % 1000,
                              &c->comm) != MPI_SUCCESS) {
      delete c;
      c = nullptr;
      result = ncclSystemError;
    } else {
      ++live_communicators;
    }
    MPI_Group_free(&group);
    *in.out = c;
  }
  MPI_Group_free(&world);
  inits.clear();
  return result;
}

}  // namespace

extern "C" {

// In the emulated runtime (emu_runtime.cpp; the executable exports it): how it completes these.
void trellis_emu_register_nccl(bool (*complete)(cudaStream_t, uint64_t, bool), uint64_t (*mark)());
}

__attribute__((constructor)) static void register_with_the_runtime() {
  trellis_emu_register_nccl(complete, mark);
}

extern "C" {

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error (emulated NCCL)";
    case ncclInvalidArgument:
      return "invalid argument (emulated NCCL)";
    case ncclSystemError:
      return "MPI failed (emulated NCCL)";
    case ncclRemoteError:
      return "remote process exited or there was a network error (emulated NCCL)";
    default:
      return "error (emulated NCCL)";
  }
}

ncclResult_t ncclGetVersion(int* version) {
  const char* env = std::getenv("TRELLIS_EMU_NCCL_VERSION");
  *version = env && *env ? std::atoi(env) : NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  if (!comm || !asyncError) return ncclInvalidArgument;
  static long calls = 0;  // while the knob is set
  const char* env = std::getenv("TRELLIS_EMU_NCCL_ASYNC_ERROR");
  const long fail_from = env && *env ? std::atol(env) : 0L;
  if (fail_from <= 0) calls = 0;
  *asyncError = fail_from > 0 && ++calls >= fail_from ? ncclRemoteError : ncclSuccess;
  return ncclSuccess;
}

// How many communicators this process holds (tests: a group of one rank gets none).
int trellis_emu_nccl_communicators() { return live_communicators; }

// How many times this process called the collective `name` ("ncclReduce", …).
long trellis_emu_nccl_calls(const char* name) {
  const auto it = collective_calls.find(name);
  return it == collective_calls.end() ? 0 : it->second;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
  static int serial = 0;
  std::memset(uniqueId, 0, sizeof(*uniqueId));
  const Id id{kMagic, world_rank(), serial++};
  std::memcpy(uniqueId->internal, &id, sizeof(id));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  Id id;
  std::memcpy(&id, commId.internal, sizeof(id));
  if (id.magic != kMagic || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  inits.push_back({comm, nranks, rank, id});
  return group_depth > 0 ? ncclSuccess : make_communicators();  // in a group: at its end
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclInvalidArgument;
  MPI_Barrier(comm->comm);  // (NCCL finalizes a communicator with its other members)
  MPI_Comm_free(&comm->comm);
  delete comm;
  --live_communicators;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t) {
  ++collective_calls["ncclAllReduce"];
  MPI_Datatype t;
  MPI_Op o;
  size_t bytes;
  if (!mpi_type(datatype, &t, &bytes) || !mpi_op(op, datatype, &o) || !fits_int(count))
    return ncclInvalidArgument;
  const void* in = sendbuff == recvbuff ? MPI_IN_PLACE : sendbuff;
  return MPI_Allreduce(in, recvbuff, int(count), t, o, comm->comm) == MPI_SUCCESS ? ncclSuccess
                                                                                  : ncclSystemError;
}

// recvbuff (recvcount) = the reduction of block `rank` of sendbuff (size · recvcount); in place
// when recvbuff is that block, as NCCL allows.
ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t) {
  ++collective_calls["ncclReduceScatter"];
  MPI_Datatype t;
  MPI_Op o;
  size_t bytes;
  if (!mpi_type(datatype, &t, &bytes) || !mpi_op(op, datatype, &o) ||
      !fits_int(recvcount * comm->size))
    return ncclInvalidArgument;
  const auto* s = static_cast<const char*>(sendbuff);
  auto* r = static_cast<char*>(recvbuff);
  std::vector<char> copy;
  if (r >= s && r < s + recvcount * comm->size * bytes) {  // overlapping: reduce from a copy
    copy.assign(s, s + recvcount * comm->size * bytes);
    s = copy.data();
  }
  return MPI_Reduce_scatter_block(s, r, int(recvcount), t, o, comm->comm) == MPI_SUCCESS
             ? ncclSuccess
             : ncclSystemError;
}

// The root's recvbuff (count) = the reduction of every rank's sendbuff; in place when the two are
// the same on the root. Elsewhere recvbuff is not touched, as NCCL's.
ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count,
                        ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
                        cudaStream_t) {
  ++collective_calls["ncclReduce"];
  MPI_Datatype t;
  MPI_Op o;
  size_t bytes;
  if (!mpi_type(datatype, &t, &bytes) || !mpi_op(op, datatype, &o) || !fits_int(count) ||
      root < 0 || root >= comm->size)
    return ncclInvalidArgument;
  const bool here = comm->rank == root;
  const void* in = here && sendbuff == recvbuff ? MPI_IN_PLACE : sendbuff;
  return MPI_Reduce(in, here ? recvbuff : nullptr, int(count), t, o, root, comm->comm) ==
                 MPI_SUCCESS
             ? ncclSuccess
             : ncclSystemError;
}

// recvbuff (size · sendcount) = every rank's sendbuff in rank order; in place when sendbuff is
// this rank's block of recvbuff.
ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t) {
  ++collective_calls["ncclAllGather"];
  MPI_Datatype t;
  size_t bytes;
  if (!mpi_type(datatype, &t, &bytes) || !fits_int(sendcount * comm->size))
    return ncclInvalidArgument;
  const void* in = sendbuff == static_cast<char*>(recvbuff) + comm->rank * sendcount * bytes
                       ? MPI_IN_PLACE
                       : sendbuff;
  return MPI_Allgather(in, int(sendcount), t, recvbuff, int(sendcount), t, comm->comm) ==
                 MPI_SUCCESS
             ? ncclSuccess
             : ncclSystemError;
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t) {
  ++collective_calls["ncclBroadcast"];
  MPI_Datatype t;
  size_t bytes;
  if (!mpi_type(datatype, &t, &bytes) || !fits_int(count) || root < 0 || root >= comm->size)
    return ncclInvalidArgument;
  if (comm->rank == root && sendbuff != recvbuff) std::memmove(recvbuff, sendbuff, count * bytes);
  return MPI_Bcast(recvbuff, int(count), t, root, comm->comm) == MPI_SUCCESS ? ncclSuccess
                                                                             : ncclSystemError;
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  MPI_Datatype t;
  size_t bytes;
  if (!mpi_type(datatype, &t, &bytes) || !fits_int(count) || peer < 0 || peer >= comm->size)
    return ncclInvalidArgument;
  return post({true, const_cast<void*>(sendbuff), int(count), t, peer, comm->comm, stream}, comm);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  MPI_Datatype t;
  size_t bytes;
  if (!mpi_type(datatype, &t, &bytes) || !fits_int(count) || peer < 0 || peer >= comm->size)
    return ncclInvalidArgument;
  return post({false, recvbuff, int(count), t, peer, comm->comm, stream}, comm);
}

ncclResult_t ncclGroupStart() {
  ++group_depth;
  return ncclSuccess;
}

// The group's sends and receives, all posted, then all completed: as NCCL, any order of matching
// pairs within a group goes through.
ncclResult_t ncclGroupEnd() {
  if (group_depth == 0) return ncclInvalidUsage;
  if (--group_depth > 0) return ncclSuccess;
  if (!inits.empty()) {
    const ncclResult_t r = make_communicators();
    if (r != ncclSuccess) return r;
  }
  const ncclResult_t r = connect(grouped, grouped_comms);
  if (r == ncclSuccess)
    for (const Pending& p : grouped) start(p);
  grouped.clear();
  grouped_comms.clear();
  return r;
}

}  // extern "C"
