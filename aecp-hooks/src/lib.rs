//! AECP on the mount: knowledge and contract artifacts (DESIGN.md §6, `docs/AECP.md`).
//!
//! * [`knowledge`] — the artifact model and the fixed delivery template.
//! * [`policy`] — the one policy struct (limits, order, forwarding) and ownership globs.
//! * [`scope`] — scope resolution at publish time (tree-sitter) and the import graph.
//! * [`index`] — the path → artifacts index a mount replicates, and its stream events.
//! * [`witness`] — the witness runner (timeout, process group, network namespace).
//! * [`store`] — the SQLite store and its append-only audit log (on the Delegator).
//! * [`hook`] — the narrow interface the mount calls on each access; `replica` (private)
//!   — what it keeps per artifact: fixed-size words in memory, lines in unnamed files.
//! * [`contract`] — contract artifacts: the model and its JSON form, `.pyi` interfaces, the
//!   stub generator and the static verifier (tree-sitter, never running code).
//! * [`python`] — the tree-sitter-python helpers.
//! * [`revision`] — revision tracking as a mount sees it: contract views, consumer standing,
//!   the revision notice template.
//! * [`screen`] — the commit screen's decision: hold a write-back that breaks its module's
//!   contract, or that imports a revised module its worker has not acknowledged.

pub mod contract;
pub mod hook;
pub mod index;
pub mod knowledge;
pub mod policy;
pub mod python;
mod replica;
pub mod revision;
pub mod scope;
pub mod screen;
pub mod store;
pub mod witness;
