"""Proof that regrouping the "trust nothing on disk" tests lost none: every test node id
collected at BASE in the five files they came from maps to exactly one node id collected now,
and every node id now in the files they went to comes from exactly one. Run from the repo root:

    .venv/bin/python tests/regroup_map.py [BASE]   (BASE defaults to 1bdcf73c38)

Not a test (pytest does not collect it); the lead may drop it once the regrouping is merged."""

from __future__ import annotations

import collections
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = sys.argv[1] if len(sys.argv) > 1 else "1bdcf73c38c421a482aabf47a1ad56975c5fb752"
OLD = ["test_adversarial.py", "test_trust_files.py", "test_bad_input.py"]
KEPT = {
    "test_trust_inputs.py": "test_disk_contents.py",
    "test_trust_outputs.py": "test_exit_codes.py",
}
NEW = [
    "test_disk_contents.py",
    "test_disk_installs.py",
    "test_disk_links_and_fifos.py",
    "test_disk_owners.py",
    "test_disk_races.py",
    "test_disk_records.py",
    "test_exit_codes.py",
]
# (old file, old test, new file, new test): a test moved out of OLD, renamed for what it asserts.
RENAMED = [
    (
        "test_adversarial.py",
        "test_7_the_lock_is_the_package_dir_and_leaves_nothing",
        "test_disk_races.py",
        "test_the_lock_is_the_package_dir_and_leaves_nothing",
    ),
    (
        "test_adversarial.py",
        "test_7_racing_applies_and_reverts_stay_whole",
        "test_disk_races.py",
        "test_racing_applies_and_reverts_leave_the_tree_whole",
    ),
    (
        "test_adversarial.py",
        "test_8_an_edit_before_the_rename_is_kept_and_no_journal_blocks",
        "test_disk_races.py",
        "test_an_edit_before_the_rename_is_kept_and_no_journal_blocks",
    ),
    (
        "test_adversarial.py",
        "test_8_an_edit_during_blobs_does_not_leave_a_journal",
        "test_disk_races.py",
        "test_an_edit_during_blobs_does_not_leave_a_journal",
    ),
    (
        "test_adversarial.py",
        "test_8_a_file_renamed_in_after_the_last_look_is_not_lost",
        "test_disk_races.py",
        "test_a_file_renamed_in_after_the_last_look_is_not_lost",
    ),
    (
        "test_adversarial.py",
        "test_8_an_edit_in_place_after_the_last_look_is_put_back",
        "test_disk_races.py",
        "test_an_edit_in_place_after_the_last_look_is_put_back",
    ),
    (
        "test_adversarial.py",
        "test_8_without_exchange_a_file_renamed_in_before_the_last_look_is_kept",
        "test_disk_races.py",
        "test_without_exchange_a_file_renamed_in_before_the_last_look_is_kept",
    ),
    (
        "test_adversarial.py",
        "test_13_lock_timeout_must_be_finite",
        "test_disk_races.py",
        "test_the_lock_timeout_must_be_finite",
    ),
    (
        "test_adversarial.py",
        "test_13_fast_path_and_full_path_share_one_timeout",
        "test_disk_races.py",
        "test_the_no_op_path_and_the_full_path_share_one_lock_timeout",
    ),
    (
        "test_adversarial.py",
        "test_13_a_lock_timeout_reads_the_same_on_the_no_op_path_and_the_full_path",
        "test_disk_races.py",
        "test_a_lock_timeout_reads_the_same_on_the_no_op_path_and_the_full_path",
    ),
    (
        "test_adversarial.py",
        "test_13_status_waits_for_a_live_apply_instead_of_saying_interrupted",
        "test_disk_races.py",
        "test_status_waits_for_a_live_apply_instead_of_saying_interrupted",
    ),
    (
        "test_adversarial.py",
        "test_9_apply_after_a_killed_revert_is_exit_0",
        "test_disk_races.py",
        "test_apply_after_a_killed_revert_is_exit_0",
    ),
    (
        "test_adversarial.py",
        "test_9_a_revert_stopped_after_its_commit_finishes_on_the_next_run",
        "test_disk_races.py",
        "test_a_revert_stopped_after_its_commit_finishes_on_the_next_run",
    ),
    (
        "test_adversarial.py",
        "test_9_recovery_puts_every_file_back_before_a_bytecode_sync_can_fail",
        "test_disk_races.py",
        "test_recovery_puts_every_file_back_before_a_bytecode_sync_can_fail",
    ),
    (
        "test_adversarial.py",
        "test_2_record_paths_outside_the_targets_are_damage",
        "test_disk_records.py",
        "test_record_paths_outside_the_targets_are_damage",
    ),
    (
        "test_adversarial.py",
        "test_2_journal_naming_an_absolute_path_is_damage",
        "test_disk_records.py",
        "test_a_journal_naming_an_absolute_path_is_damage",
    ),
    (
        "test_adversarial.py",
        "test_2_a_commit_writes_only_registered_targets",
        "test_disk_records.py",
        "test_a_commit_writes_only_registered_targets",
    ),
    (
        "test_adversarial.py",
        "test_12_record_with_empty_scan_does_not_vouch_for_a_pristine_tree",
        "test_disk_records.py",
        "test_a_record_with_an_empty_scan_does_not_vouch_for_a_pristine_tree",
    ),
    (
        "test_adversarial.py",
        "test_12_the_static_targets_are_the_patches_files_or_the_registry_refuses",
        "test_disk_records.py",
        "test_the_no_op_paths_targets_are_the_patches_files_or_the_registry_refuses",
    ),
    (
        "test_adversarial.py",
        "test_5_a_bad_record_is_never_overwritten_or_pruned",
        "test_disk_records.py",
        "test_a_bad_record_is_never_overwritten_or_pruned",
    ),
    (
        "test_adversarial.py",
        "test_5_revert_without_a_record_keeps_the_saved_originals",
        "test_disk_records.py",
        "test_revert_without_a_record_keeps_the_saved_originals",
    ),
    (
        "test_adversarial.py",
        "test_10_plugin_warns_never_raises_on_a_damaged_record",
        "test_disk_records.py",
        "test_the_plugin_warns_never_raises_on_a_damaged_record",
    ),
    (
        "test_adversarial.py",
        "test_10_plugin_survives_an_unexpected_error",
        "test_disk_records.py",
        "test_the_plugin_survives_an_unexpected_error",
    ),
    (
        "test_adversarial.py",
        "test_21_the_plugin_says_record_damaged_not_that_the_files_differ",
        "test_disk_records.py",
        "test_the_plugin_says_record_damaged_not_that_the_files_differ",
    ),
    (
        "test_adversarial.py",
        "test_15_odd_state_entries_are_environment_problems",
        "test_disk_records.py",
        "test_a_state_dir_that_is_a_file_or_a_journal_that_is_a_dir_is_exit_3",
    ),
    (
        "test_trust_files.py",
        "test_11_status_gives_the_code_verdicts_names_the_problem_and_exits_3",
        "test_disk_records.py",
        "test_status_with_an_unusable_state_dir_gives_the_code_verdicts_and_exits_3",
    ),
    (
        "test_adversarial.py",
        "test_3_blobs_as_a_symlink_is_refused_and_the_target_dir_untouched",
        "test_disk_links_and_fifos.py",
        "test_blobs_as_a_symlink_is_refused_and_the_linked_dir_untouched",
    ),
    (
        "test_adversarial.py",
        "test_3_prune_removes_only_blob_named_regular_files",
        "test_disk_links_and_fifos.py",
        "test_prune_removes_only_blob_named_regular_files",
    ),
    (
        "test_adversarial.py",
        "test_4_links_at_the_old_predictable_names_are_never_written_through",
        "test_disk_links_and_fifos.py",
        "test_links_at_predictable_temp_names_are_never_written_through",
    ),
    (
        "test_adversarial.py",
        "test_4_a_link_at_the_very_name_chosen_is_never_opened",
        "test_disk_links_and_fifos.py",
        "test_a_link_at_the_very_temp_name_chosen_is_never_opened",
    ),
    (
        "test_adversarial.py",
        "test_6_a_symlinked_directory_on_the_way_is_refused",
        "test_disk_links_and_fifos.py",
        "test_a_symlinked_directory_on_the_way_is_refused_before_any_write",
    ),
    (
        "test_adversarial.py",
        "test_pycache_symlink_is_refused_before_any_write",
        "test_disk_links_and_fifos.py",
        "test_pycache_symlink_is_refused_before_any_write",
    ),
    (
        "test_adversarial.py",
        "test_11_a_fifo_target_is_refused_without_hanging",
        "test_disk_links_and_fifos.py",
        "test_a_fifo_target_is_refused_without_hanging",
    ),
    (
        "test_adversarial.py",
        "test_11_the_no_op_path_never_vouches_through_a_link_or_a_fifo",
        "test_disk_links_and_fifos.py",
        "test_the_no_op_path_never_vouches_through_a_link_or_a_fifo",
    ),
    (
        "test_adversarial.py",
        "test_21_the_plugin_never_blocks_on_a_fifo",
        "test_disk_links_and_fifos.py",
        "test_the_plugin_never_blocks_on_a_fifo",
    ),
    (
        "test_trust_files.py",
        "test_1_a_fifo_anywhere_k3patch_reads_is_refused_never_blocked_on",
        "test_disk_links_and_fifos.py",
        "test_a_fifo_anywhere_k3patch_reads_is_refused_never_blocked_on",
    ),
    (
        "test_trust_files.py",
        "test_1_the_cli_exits_3_on_a_fifo_with_one_line",
        "test_disk_links_and_fifos.py",
        "test_the_cli_exits_3_on_a_fifo_with_one_line",
    ),
    (
        "test_trust_files.py",
        "test_1_recovery_of_an_interrupted_apply_never_blocks_on_a_pyc_fifo",
        "test_disk_links_and_fifos.py",
        "test_recovery_of_an_interrupted_apply_never_blocks_on_a_pyc_fifo",
    ),
    (
        "test_trust_files.py",
        "test_1_bytecode_is_removed_never_compiled_with_a_blocking_open",
        "test_disk_links_and_fifos.py",
        "test_bytecode_is_removed_never_compiled_with_a_blocking_open",
    ),
    (
        "test_adversarial.py",
        "test_1_upgrade_then_revert_leaves_the_new_version",
        "test_disk_installs.py",
        "test_revert_after_an_upgrade_and_a_new_apply_leaves_the_new_version",
    ),
    (
        "test_adversarial.py",
        "test_1_upgrade_without_new_apply_revert_names_both_hashes",
        "test_disk_installs.py",
        "test_revert_after_an_upgrade_without_a_new_apply_names_both_hashes",
    ),
    (
        "test_adversarial.py",
        "test_1_force_reinstall_then_revert_is_clean",
        "test_disk_installs.py",
        "test_revert_after_a_force_reinstall_is_clean",
    ),
    (
        "test_adversarial.py",
        "test_1_a_hand_edit_on_top_of_the_patch_keeps_the_original",
        "test_disk_installs.py",
        "test_a_hand_edit_on_top_of_the_patch_keeps_the_original_recorded",
    ),
    (
        "test_adversarial.py",
        "test_1_orphan_state_dir_after_uninstall_is_exit_3",
        "test_disk_installs.py",
        "test_a_state_dir_left_by_an_uninstall_is_exit_3",
    ),
    (
        "test_trust_files.py",
        "test_4_several_dist_infos_the_one_whose_record_owns_the_files_decides",
        "test_disk_installs.py",
        "test_of_several_dist_infos_the_one_whose_record_owns_the_files_decides",
    ),
    (
        "test_trust_files.py",
        "test_4_an_older_package_under_a_newer_dist_info_reads_as_itself",
        "test_disk_installs.py",
        "test_an_older_package_beside_a_newer_dist_info_reads_as_itself",
    ),
    (
        "test_trust_files.py",
        "test_4_when_no_record_tells_the_version_is_unknown",
        "test_disk_installs.py",
        "test_the_version_is_unknown_when_no_record_tells",
    ),
    (
        "test_trust_files.py",
        "test_4_a_record_with_the_package_hashes_is_parsed_as_pip_writes_it",
        "test_disk_installs.py",
        "test_a_dist_info_record_is_parsed_as_pip_writes_it",
    ),
    (
        "test_adversarial.py",
        "test_14_owner_special_bits_and_xattrs_survive_apply_and_revert",
        "test_disk_owners.py",
        "test_owner_special_bits_and_xattrs_survive_apply_and_revert",
    ),
    (
        "test_adversarial.py",
        "test_14_every_file_written_and_its_directory_are_fsynced",
        "test_disk_owners.py",
        "test_every_file_written_and_its_directory_are_fsynced",
    ),
    (
        "test_adversarial.py",
        "test_14_a_split_hard_link_is_reported",
        "test_disk_owners.py",
        "test_a_split_hard_link_is_reported",
    ),
    (
        "test_trust_files.py",
        "test_5_an_apply_under_umask_077_leaves_a_record_every_reader_can_read",
        "test_disk_owners.py",
        "test_an_apply_under_umask_077_leaves_a_record_every_reader_can_read",
    ),
    (
        "test_trust_files.py",
        "test_5_a_record_this_user_cannot_read_is_named_never_absent",
        "test_disk_owners.py",
        "test_a_record_this_user_cannot_read_is_named_never_absent",
    ),
    (
        "test_bad_input.py",
        "test_a_record_another_user_cannot_read_is_named_by_status",
        "test_disk_owners.py",
        "test_status_as_another_user_names_a_record_it_cannot_read",
    ),
    (
        "test_trust_files.py",
        "test_6_no_chown_when_the_owner_and_group_are_already_the_files",
        "test_disk_owners.py",
        "test_no_chown_when_the_owner_and_group_are_already_the_files",
    ),
    (
        "test_trust_files.py",
        "test_6_a_refused_chown_of_a_file_this_process_does_not_own_names_the_owner",
        "test_disk_owners.py",
        "test_a_refused_chown_of_another_users_file_names_the_owner",
    ),
    (
        "test_trust_files.py",
        "test_6_the_owner_outside_the_files_group_applies_in_a_setgid_dir",
        "test_disk_owners.py",
        "test_the_owner_outside_the_files_group_applies_in_a_setgid_dir",
    ),
    (
        "test_bad_input.py",
        "test_permission_denied_as_another_user",
        "test_disk_owners.py",
        "test_another_user_who_may_not_write_gets_exit_3_and_may_still_read",
    ),
    (
        "test_bad_input.py",
        "test_a_pyc_this_user_cannot_read_is_removed_not_fatal",
        "test_disk_owners.py",
        "test_a_pyc_this_user_cannot_read_is_removed_not_fatal",
    ),
    (
        "test_bad_input.py",
        "test_read_only_filesystem",
        "test_disk_owners.py",
        "test_a_read_only_filesystem_is_exit_3_and_status_still_reads",
    ),
    (
        "test_bad_input.py",
        "test_full_disk",
        "test_disk_owners.py",
        "test_a_full_disk_leaves_nothing_behind",
    ),
    (
        "test_bad_input.py",
        "test_unreadable_target_is_drift_and_untouched",
        "test_disk_contents.py",
        "test_the_cli_names_a_target_that_is_not_python_and_writes_nothing",
    ),
    (
        "test_adversarial.py",
        "test_11_deep_expressions_are_drift_not_a_traceback",
        "test_disk_contents.py",
        "test_deep_expressions_are_drift_not_a_traceback",
    ),
    (
        "test_adversarial.py",
        "test_15_closed_pipe_and_full_stdout_after_a_commit_keep_its_code",
        "test_exit_codes.py",
        "test_a_closed_pipe_or_a_full_stdout_after_a_commit_keeps_its_code",
    ),
    (
        "test_adversarial.py",
        "test_15_non_executable_python_is_exit_3",
        "test_exit_codes.py",
        "test_a_non_executable_python_for_verify_is_exit_3",
    ),
    (
        "test_adversarial.py",
        "test_16_verify_with_an_interpreter_lacking_torch_is_exit_3",
        "test_exit_codes.py",
        "test_verify_with_an_interpreter_lacking_torch_is_exit_3",
    ),
]


def collect(root: Path, files: list[str]) -> list[str]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "",
            "-p",
            "no:cacheprovider",
            *[f"tests/{f}" for f in files],
        ],
        cwd=root,
        capture_output=True,
        text=True,
    )
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert ids, proc.stdout + proc.stderr
    return [i.removeprefix("tests/") for i in ids]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "archive", BASE, "tests", "pyproject.toml"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        tarfile.open(fileobj=BytesIO(archive)).extractall(tmp)
        before = collect(Path(tmp), OLD + list(KEPT))
    after = collect(ROOT, NEW)
    rename = {(f, t): (nf, nt) for f, t, nf, nt in RENAMED}
    mapped = collections.Counter()
    lines = []
    for node in before:
        file, _, rest = node.partition("::")
        name, bracket, params = rest.partition("[")
        if file in KEPT:
            new = f"{KEPT[file]}::{rest}"
        else:
            new_file, new_name = rename[(file, name)]
            new = f"{new_file}::{new_name}{bracket}{params}"
        mapped[new] += 1
        lines.append(f"{node}  ->  {new}")
    print("\n".join(lines))
    lost = [n for n in mapped if n not in after]
    twice = [n for n, c in mapped.items() if c > 1]
    unmapped = [n for n in after if n not in mapped]
    per_file = lambda ids: collections.Counter(i.partition("::")[0] for i in ids)  # noqa: E731
    print("\nbefore:", len(before), dict(sorted(per_file(before).items())))
    print("after: ", len(after), dict(sorted(per_file(after).items())))
    print(f"lost: {len(lost)}, mapped twice: {len(twice)}, new and unmapped: {len(unmapped)}")
    for n in lost + twice + unmapped:
        print("  ", n)
    return 1 if lost or twice or unmapped else 0


if __name__ == "__main__":
    sys.exit(main())
